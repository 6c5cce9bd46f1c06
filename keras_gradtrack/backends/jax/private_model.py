"""Private training on the JAX backend: what `make_private` refuses, and `fit`'s checks.

The settings, the history, epsilon and saving are the shared `PrivateTraining`'s
(`engine/private_model.py`); the budget and the batch checks are the shared
`private_training`'s; the step is `private_step.py`'s.

Example:

```python
import os; os.environ["KERAS_BACKEND"] = "jax"
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=256 / len(x))
model.fit(x, y, batch_size=256, epochs=3)
model.epsilon(1e-5)
```
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from keras_gradtrack.backends.jax.plan import BACKEND
from keras_gradtrack.backends.jax.private_step import logical_iterations, private_gradients
from keras_gradtrack.backends.jax.step import batch_size_of, tracked_train_step
from keras_gradtrack.engine import private_training
from keras_gradtrack.engine.private_model import PrivateTraining

# `fit`'s data as `private_training.fit_data` reads it, until its first batch is seen.
FIT_DATA_KEY = "_private_fit_data"


def not_on_jax(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} runs on the TensorFlow backend only; private training on the {BACKEND} "
        "backend (keras.backend.backend() == 'jax') does not have it yet. Train with "
        "KERAS_BACKEND=tensorflow for it."
    )


class JaxPrivateTraining(PrivateTraining):
    """`make_private` on JAX: one bound or bounds per group, the noise, logical
    batches, the history, the budget and the sampling checks; each refusal below
    names the backend."""

    def _refuse_private(self, **arguments: Any) -> None:
        optimizer = getattr(self, "optimizer", None)
        if arguments.get("adaptive_clip") is not None:
            raise not_on_jax("Adaptive clipping (`adaptive_clip=`)")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise not_on_jax("Private training with a LossScaleOptimizer")
        own_step = self._has_own_step()  # type: ignore[attr-defined]
        own_loss = type(self).compute_loss is not keras.Model.compute_loss  # type: ignore[attr-defined]
        if own_step or own_loss:
            raise not_on_jax("Private training of a model with its own train_step or compute_loss")

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
        # Keras' JAX `fit` passes its first batch here (ids taken off) before any step.
        fit_data = self.__dict__.pop(FIT_DATA_KEY, None)
        if fit_data is not None and data_batch is not None:
            size = batch_size_of(keras.utils.unpack_x_y_sample_weight(data_batch)[0])
            private_training.check_batches(self, fit_data[0], size, fit_data[1])
        build = super()._symbolic_build  # type: ignore[misc]
        return build(iterator=iterator, data_batch=data_batch)

    def _private_iterations(self, state: Any) -> int | None:
        """The optimizer's logical iterations in `state` (read before the step donates
        it), with accumulation; None without."""
        return logical_iterations(self, state[2])

    def _record_private_step(self, iterations_before: int | None, state: Any) -> None:
        """Adds the step's optimizer updates to the current phase of the history: one,
        or with accumulation the change of the logical iterations."""
        updates = 1
        if iterations_before is not None:
            updates = int(logical_iterations(self, state[2]) or 0) - iterations_before
        private_training.record_steps(self, updates)

    def _private_train_step(self) -> Any:
        """The tracked step whose optimizer receives the private gradients."""
        return functools.partial(tracked_train_step, private=private_gradients)
