"""`make_private` on the probed engines: `fit`'s checks and the adaptive bound's variable.

The settings, the history, epsilon and saving are the shared `PrivateTraining`'s
(`engine/private_model.py`); the budget and the batch checks are the shared
`private_training`'s. This class adds what the JAX and PyTorch engines do alike
around them: `fit` reads what its input says of the dataset (`fit_data`) and checks
it against the settings on the first batch, which Keras' trainer passes to
`_symbolic_build` before any step; with adaptive clipping, a new phase keeps its
bound `C_t` in a non-trainable Keras variable (in the model's `__dict__`, not one of
its weights, `BOUND_KEY`), which the engines' private steps read and update.

Example:

```python
class JaxPrivateTraining(ProbedPrivateTraining): ...   # the engine's step added
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.ops.step import batch_size_of
from keras_gradtrack.engine import private_training
from keras_gradtrack.engine.private_model import PrivateTraining

# Where a model with adaptive clipping keeps its bound `C_t`.
BOUND_KEY = "_adaptive_clip_bound"
# `fit`'s data as `private_training.fit_data` reads it, until its first batch is seen.
FIT_DATA_KEY = "_private_fit_data"


class ProbedPrivateTraining(PrivateTraining):
    """`PrivateTraining` with `fit`'s checks and the adaptive bound's variable, for the
    JAX and PyTorch engines' mixins."""

    def _started_private_phase(self) -> None:
        settings = self.privacy_settings
        if settings is not None and settings.adaptive_clip is not None:
            # The bound C_t, updated by every step; in `__dict__`, not a weight.
            self.__dict__[BOUND_KEY] = keras.Variable(
                settings.sensitivity, dtype="float32", trainable=False, name="adaptive_clip_bound"
            )

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        if self.privacy_settings is not None:
            if private_training.budget_steps_left(self) == 0:
                raise ValueError(private_training.budget_refusal(self))
            self.__dict__[FIT_DATA_KEY] = private_training.fit_data(
                args[0] if args else kwargs.get("x"), kwargs
            )
        try:
            return super().fit(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__.pop(FIT_DATA_KEY, None)

    def _symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        # Keras' `fit` (JAX, PyTorch) passes its first batch here (ids taken off) before any step.
        fit_data = self.__dict__.pop(FIT_DATA_KEY, None)
        if fit_data is not None and data_batch is not None:
            size = batch_size_of(keras.utils.unpack_x_y_sample_weight(data_batch)[0])
            private_training.check_batches(self, fit_data[0], size, fit_data[1])
        build = super()._symbolic_build  # type: ignore[misc]
        return build(iterator=iterator, data_batch=data_batch)
