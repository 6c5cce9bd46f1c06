"""`BatchNormalizationTracking`: a model's opt-in to tracking BatchNormalization in training.

In training mode BatchNormalization normalizes with the batch's statistics, so
example i's loss depends on the other examples. Unless the model opts in, the
first tracked step is refused with the choices (see docs/batch_normalization.md).
Both engines' mixins read these settings (TensorFlow: `engine/coupled.py`; JAX:
`backends/jax/coupled.py`).
"""

from __future__ import annotations

from typing import Any

# Examples per vectorized chunk unless the model says otherwise.
DEFAULT_CHUNK_SIZE = 8


class BatchNormalizationTracking:
    """The settings of `GradientTrackingMixin` for BatchNormalization in training mode.

    Both are read when a tracked step is traced; changing one traces it again.
    """

    # Keras' trainer's compiled step (None until made), which the settings reset.
    train_function: Any

    @property
    def track_batch_normalization(self) -> bool:
        """Whether BatchNormalization layers may train on tracked steps (default False).

        In training mode BatchNormalization normalizes with the batch's statistics,
        so example i's loss depends on the other examples. With this set,
        `g_i = d l_i / d theta` holds the other examples fixed and includes the
        terms through the batch mean and variance (`sum_i g_i = G` exactly). It
        costs, on each tracked step, about one backward pass per example through
        the layers before the last BatchNormalization in training mode
        (vectorized, `batch_normalization_chunk_size` examples at a time):
        combine it with the logger's `every_n_steps`. Layers after it, and its
        own gamma and beta, keep their rules. Unset, such a model is refused
        with this advice and the alternatives (freezing the layers, or
        `kgt.convert_to_group_normalization`).

        Example:

        ```python
        model = kgt.GradientTrackingModel(inputs, outputs)   # Conv2D + BatchNormalization
        model.track_batch_normalization = True
        model.fit(x, y, callbacks=[kgt.HDF5GradientLogger("run.h5", every_n_steps=50)])
        ```
        """
        return bool(self.__dict__.get("_track_batch_normalization", False))

    @track_batch_normalization.setter
    def track_batch_normalization(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"Expected track_batch_normalization to be a bool. Received: {value!r}")
        self.__dict__["_track_batch_normalization"] = value
        self._forget_traced_steps()

    @property
    def batch_normalization_chunk_size(self) -> int:
        """Examples whose gradients through BatchNormalization are computed at once (default 8).

        Memory grows with it (chunk x the parameters of the layers before the
        last BatchNormalization, and chunk x their activations); so, up to a
        point, does speed. See `track_batch_normalization`.
        """
        return int(self.__dict__.get("_batch_normalization_chunk_size", DEFAULT_CHUNK_SIZE))

    @batch_normalization_chunk_size.setter
    def batch_normalization_chunk_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"Expected batch_normalization_chunk_size to be a positive int. Received: {value!r}"
            )
        self.__dict__["_batch_normalization_chunk_size"] = value
        self._forget_traced_steps()

    def _forget_traced_steps(self) -> None:
        # Both settings are read when a tracked step is traced: trace again.
        self.__dict__.pop("_gradient_statistics_functions", None)
        if getattr(self, "train_function", None) is not None:
            self.train_function = None
