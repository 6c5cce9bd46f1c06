"""`PrivacyAccountant`: epsilon so far, in `fit`'s logs and a gradient log's attributes."""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.privacy.accounting import EpsilonCurve, check_arguments

# Where the model holds its accountant, for the gradient logs of the same model
# (`engine/private_logs.py` reads it).
ACCOUNTANT_KEY = "_privacy_accountant"


class PrivacyAccountant(keras.callbacks.Callback):
    """Puts the privacy spent so far (`epsilon` at `delta`) in `fit`'s batch and epoch logs.

    With the RDP accountant every step's batch logs hold `epsilon` (about 0.1 ms a
    step: one step's RDP curve is computed once and scaled); with PLD, whose every
    computation composes anew (about 0.5 s), only every `batch_epsilon_every`-th
    step's, if asked for. The epoch logs always hold it.

    An `HDF5GradientLogger` of the same model writes the privacy spent into its
    log's root attributes when it closes (the end of `fit`): `dp_epsilon`,
    `dp_delta`, `dp_sampling_rate`, `dp_steps`, `dp_accountant`. It finds the
    accountant through the model (the last one a `fit` of the model used), so
    the accountant need not be given the logger.

    Reads the noise multiplier and the count of private steps from the model
    (`make_private`). Without `sampling_rate`, `q` is taken as one over the steps of
    an epoch (shuffled fixed-size batches, accounted as if Poisson-sampled: the
    accountant assumes Poisson sampling; `poisson_batches` provides it).

    Args:
        delta: The target delta.
        sampling_rate: `q`, each example's probability to be in a batch.
        accountant: `"rdp"` or `"pld"`.
        logger: Optional `HDF5GradientLogger` of the same fit, closed at the end
            of training by this callback (no longer needed for the attributes).
        batch_epsilon_every: Put epsilon in the batch logs of every this many
            steps (counted by `model.private_steps`); 0: only in the epoch
            logs. None (default): 1 with `"rdp"`, 0 with `"pld"`.

    Attributes:
        epsilon: The epsilon after the last epoch (None before).

    Example:

    ```python
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1)
    history = model.fit(x, y, batch_size=256, epochs=3,
                        callbacks=[kgt.privacy.PrivacyAccountant(delta=1e-5)])
    history.history["epsilon"]
    ```
    """

    def __init__(
        self,
        delta: float,
        sampling_rate: float | None = None,
        accountant: str = "rdp",
        logger: Any = None,
        batch_epsilon_every: int | None = None,
    ) -> None:
        super().__init__()
        self.logger = logger
        check_arguments(1.0 if sampling_rate is None else sampling_rate, 0, delta, accountant)
        if batch_epsilon_every is None:
            batch_epsilon_every = 1 if accountant == "rdp" else 0
        if (
            isinstance(batch_epsilon_every, bool)
            or not isinstance(batch_epsilon_every, int)
            or batch_epsilon_every < 0
        ):
            raise ValueError(
                "Expected batch_epsilon_every to be an integer >= 0 or None. "
                f"Received: batch_epsilon_every={batch_epsilon_every!r}"
            )
        self.delta = delta
        self.sampling_rate = sampling_rate
        self.accountant = accountant
        self.batch_epsilon_every = batch_epsilon_every
        self.epsilon: float | None = None
        self._curve: EpsilonCurve | None = None

    def privacy_spent(self) -> float:
        """Epsilon at `delta` after the model's private steps so far."""
        settings = getattr(self.model, "privacy_settings", None)
        if settings is None:
            raise ValueError(
                "PrivacyAccountant needs a private model: call `model.make_private(...)` "
                f"before fit. Received: model {self.model.name!r} without privacy settings"
            )
        curve = self._curve
        if (
            curve is None
            or curve.noise_multiplier != settings.noise_multiplier
            or curve.sampling_rate != self.rate()
        ):
            curve = self._curve = EpsilonCurve(
                settings.noise_multiplier, self.rate(), self.delta, self.accountant
            )
        return curve.epsilon(self.model.private_steps)

    def spent_attrs(self) -> dict[str, Any]:
        """The privacy spent so far as a gradient log's root attributes."""
        return {
            "dp_epsilon": self.privacy_spent(),
            "dp_delta": float(self.delta),
            "dp_sampling_rate": self.rate(),
            "dp_steps": int(self.model.private_steps),
            "dp_accountant": self.accountant,
        }

    def rate(self) -> float:
        """`q`: as given, or one over the steps of an epoch."""
        if self.sampling_rate is not None:
            return float(self.sampling_rate)
        return min(1.0, 1.0 / max(1, int(self.params.get("steps") or 1)))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.privacy_spent()  # refuses a model that is not private before any step
        self.model.__dict__[ACCOUNTANT_KEY] = self

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        every = self.batch_epsilon_every
        if logs is not None and every and self.model.private_steps % every == 0:
            logs["epsilon"] = self.privacy_spent()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epsilon = self.privacy_spent()
        if logs is not None:
            logs["epsilon"] = self.epsilon

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.epsilon = self.privacy_spent()
        if self.logger is not None:
            # Closing writes the attributes (closing twice is harmless).
            self.logger.close()
