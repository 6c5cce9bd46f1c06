"""`PrivacyAccountant`: epsilon so far, in `fit`'s logs and a gradient log's attributes."""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_gradtrack.privacy.accounting import check_arguments, compute_epsilon


class PrivacyAccountant(keras.callbacks.Callback):
    """Puts the privacy spent so far (`epsilon` at `delta`) in `fit`'s logs after every epoch.

    Given the fit's `HDF5GradientLogger`, it also writes the privacy spent into the
    log's root attributes when training ends: `dp_epsilon`, `dp_delta`,
    `dp_sampling_rate`, `dp_steps`, `dp_accountant`.

    Reads the noise multiplier and the count of private steps from the model
    (`make_private`). Without `sampling_rate`, `q` is taken as one over the steps of
    an epoch (shuffled fixed-size batches, accounted as if Poisson-sampled: the
    accountant assumes Poisson sampling; `poisson_batches` provides it).

    Args:
        delta: The target delta.
        sampling_rate: `q`, each example's probability to be in a batch.
        accountant: `"rdp"` or `"pld"`.
        logger: Optional `HDF5GradientLogger` of the same fit, whose file receives
            the attributes.

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
    ) -> None:
        super().__init__()
        self.logger = logger
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
        return compute_epsilon(
            settings.noise_multiplier,
            self.rate(),
            self.model.private_steps,
            self.delta,
            self.accountant,
        )

    def rate(self) -> float:
        """`q`: as given, or one over the steps of an epoch."""
        if self.sampling_rate is not None:
            return float(self.sampling_rate)
        return min(1.0, 1.0 / max(1, int(self.params.get("steps") or 1)))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.privacy_spent()  # refuses a model that is not private before any step

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epsilon = self.privacy_spent()
        if logs is not None:
            logs["epsilon"] = self.epsilon

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.epsilon = self.privacy_spent()
        if self.logger is None:
            return
        # The logger's file is complete once closed (closing twice is harmless).
        self.logger.close()
        if not os.path.exists(self.logger.path):
            return  # not the chief worker: it wrote no file
        import h5py

        with h5py.File(self.logger.path, "r+") as file:
            file.attrs.update(
                {
                    "dp_epsilon": self.epsilon,
                    "dp_delta": float(self.delta),
                    "dp_sampling_rate": self.rate(),
                    "dp_steps": int(self.model.private_steps),
                    "dp_accountant": self.accountant,
                }
            )
