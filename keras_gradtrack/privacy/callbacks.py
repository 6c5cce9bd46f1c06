"""`PrivacyAccountant`: epsilon so far, in `fit`'s logs and a gradient log's attributes."""

from __future__ import annotations

import math
from typing import Any

import keras

from keras_gradtrack.privacy.accounting import check_arguments
from keras_gradtrack.privacy.budget import PrivacyBudget, epsilon_after
from keras_gradtrack.privacy.history import PrivacyPhase, history_json, with_rate

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

    Composes every phase of the model's `privacy_history` (each `make_private`
    starts one: its noise multiplier, sampling rate and steps). A phase whose
    sampling rate `make_private` was not told (neither `sampling_rate` nor
    `dataset_size`) takes `sampling_rate` given here, or else one over the steps of
    an epoch (shuffled fixed-size batches, accounted as if Poisson-sampled: the
    accountant assumes Poisson sampling; `poisson_batches` provides it). A
    `sampling_rate` given here that differs from a phase's own is refused before
    any step.

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
        self._curve: tuple[Any, Any] | None = None

    def phases(self) -> tuple[PrivacyPhase, ...]:
        """The model's privacy history, each phase with its sampling rate.

        Raises:
            ValueError: For a model without privacy, or a `sampling_rate` given
                here other than a phase's own.
        """
        if getattr(self.model, "privacy_settings", None) is None:
            raise ValueError(
                "PrivacyAccountant needs a private model: call `model.make_private(...)` "
                f"before fit. Received: model {self.model.name!r} without privacy settings"
            )
        phases = self.model.privacy_history
        for phase in phases:
            rate, given = phase.sampling_rate, self.sampling_rate
            if rate is not None and given is not None and not math.isclose(rate, given):
                raise ValueError(
                    f"PrivacyAccountant was given sampling_rate={given}, but the model's "
                    f"privacy history has a phase at sampling_rate={rate} ({phase}). "
                    "Leave `sampling_rate` out: the history says it."
                )
        return with_rate(phases, self.rate())

    def privacy_spent(self) -> float:
        """Epsilon at `delta` after every phase of the model's private steps so far."""
        *prior, phase = self.phases()
        if not any(p.steps for p in (*prior, phase)):
            return 0.0
        if any(p.noise_multiplier == 0 for p in (*prior, phase) if p.steps):
            return float("inf")
        assert phase.sampling_rate is not None
        key = (tuple(prior), phase.noise_multiplier, phase.sampling_rate)
        if self._curve is None or self._curve[0] != key:
            budget = PrivacyBudget(math.inf, self.delta, self.accountant)
            self._curve = (
                key,
                epsilon_after(budget, prior, phase.noise_multiplier, phase.sampling_rate),
            )
        return float(self._curve[1](phase.steps))

    def spent_attrs(self) -> dict[str, Any]:
        """The privacy spent so far as a gradient log's root attributes."""
        phases = self.phases()
        return {
            "dp_epsilon": self.privacy_spent(),
            "dp_delta": float(self.delta),
            "dp_sampling_rate": float(phases[-1].sampling_rate or math.nan),
            "dp_steps": int(self.model.private_steps),
            "dp_accountant": self.accountant,
            "dp_privacy_history": history_json(phases),
        }

    def rate(self) -> float:
        """`q`: as given, or `k` over the steps of an epoch (`k` batches a step)."""
        if self.sampling_rate is not None:
            return float(self.sampling_rate)
        settings = getattr(self.model, "privacy_settings", None)
        batches = getattr(settings, "accumulation_steps", 1)
        steps = int((self.params or {}).get("steps") or 1)
        return min(1.0, batches / max(1, steps))

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
