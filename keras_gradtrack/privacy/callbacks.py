"""`PrivacyAccountant`: epsilon so far, in `fit`'s logs."""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.privacy.accounting import check_arguments, compute_epsilon


class PrivacyAccountant(keras.callbacks.Callback):
    """Puts the privacy spent so far (`epsilon` at `delta`) in `fit`'s logs after every epoch.

    Reads the noise multiplier and the count of private steps from the model
    (`make_private`). Without `sampling_rate`, `q` is taken as one over the steps of
    an epoch (shuffled fixed-size batches, accounted as if Poisson-sampled: the
    accountant assumes Poisson sampling; `poisson_batches` provides it).

    Args:
        delta: The target delta.
        sampling_rate: `q`, each example's probability to be in a batch.
        accountant: `"rdp"` or `"pld"`.

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
        self, delta: float, sampling_rate: float | None = None, accountant: str = "rdp"
    ) -> None:
        super().__init__()
        check_arguments(1.0 if sampling_rate is None else sampling_rate, 0, delta, accountant)
        self.delta = delta
        self.sampling_rate = sampling_rate
        self.accountant = accountant
        self.epsilon: float | None = None

    def privacy_spent(self) -> float:
        """Epsilon at `delta` after the model's private steps so far."""
        settings = getattr(self.model, "privacy_settings", None)
        if settings is None:
            raise ValueError(
                "PrivacyAccountant needs a private model: call `model.make_private(...)` "
                f"before fit. Received: model {self.model.name!r} without privacy settings"
            )
        rate = self.sampling_rate
        if rate is None:
            rate = min(1.0, 1.0 / max(1, int(self.params.get("steps") or 1)))
        return compute_epsilon(
            settings.noise_multiplier, rate, self.model.private_steps, self.delta, self.accountant
        )

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.privacy_spent()  # refuses a model that is not private before any step

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epsilon = self.privacy_spent()
        if logs is not None:
            logs["epsilon"] = self.epsilon
