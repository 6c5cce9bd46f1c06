"""What the probed engines' `GradientTrackingMixin`s share (JAX, PyTorch): Keras' hooks
around the tracked steps.

`fit` decides whether the example-independence guard runs before its first tracked
step and ends every subscription however it ends; `train_on_batch` does the same for a
loop of single steps; the example ids are taken off the data before Keras builds the
model and in evaluation and prediction; `_has_own_step` says whether the user's class
defines a `train_step` of its own. Each engine's mixin adds its train function and its
step.

Example:

```python
class GradientTrackingMixin(ProbedTrackingMixin, ExampleIndependenceChecks, ...):
    def make_train_function(self, force=False): ...
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_gradtrack.backends.ops.plan import TrackedLayer, plan_summary
from keras_gradtrack.backends.ops.step import split_example_ids
from keras_gradtrack.engine.example_independence import (
    IndependenceGuard,
    subscribes_to_gradients,
)
from keras_gradtrack.engine.schedule import first_data_batch

# The package whose classes define the engines' own steps (not a user's).
ENGINES = "keras_gradtrack.backends."


class ProbedTrackingMixin:
    """Keras' hooks of a probed engine's mixin (see the module). It comes first among the
    mixin's bases: its `fit` and `_symbolic_build` run before the private training's
    (which reads the first batch these give it, ids taken off)."""

    def gradient_tracking_summary(self, print_fn: Callable[[str], Any] | None = None) -> str:
        """Prints (and returns) which path computes each layer's per-example gradients.

        Example:

        ```python
        model.gradient_tracking_summary()
        # column  layer   class  params  path
        # 0       hidden  Dense  8256    rule:dense
        ```
        """
        plan = self.gradient_tracking_plan()
        return plan_summary(plan, self._layer_path, print_fn, self._execution_notes())

    def _layer_path(self, tracked: TrackedLayer) -> str:
        return tracked.path

    def _execution_notes(self) -> list[str]:
        """Lines under the summary's table: how the tracked steps run, where not as
        Keras runs its own step (none by default)."""
        return []

    @property
    def distribute_strategy(self) -> None:
        """None: `tf.distribute` strategies exist on TensorFlow only (loggers ask for one)."""
        return None

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        callbacks = args[5] if len(args) > 5 else kwargs.get("callbacks")
        self.__dict__["_independence_guard"] = IndependenceGuard(
            self.check_example_independence  # type: ignore[attr-defined]
            and (
                subscribes_to_gradients(callbacks) or self.privacy_settings is not None  # type: ignore[attr-defined]
            )
        )
        try:
            return super().fit(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__["_independence_guard"] = None
            # However fit ends, its subscribers finish: their files get every step.
            self.gradient_tracking.end_fit()

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        # A loop of train_on_batch calls: checked once per model (fit: per signature).
        self.__dict__["_independence_guard"] = IndependenceGuard(
            self.check_example_independence  # type: ignore[attr-defined]
            and self.gradient_tracking.subscribed()
            and not self.__dict__.get("_examples_independent")
        )
        try:
            return super().train_on_batch(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__["_independence_guard"] = None

    def _has_own_step(self) -> bool:
        """Whether a class of the model other than the engines' and Keras' own defines
        `train_step` (the first such in the method resolution order)."""
        for klass in type(self).__mro__:
            if klass.__module__.startswith(ENGINES) or "train_step" not in vars(klass):
                continue
            return vars(klass)["train_step"] is not keras.Model.train_step
        return False

    def _symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        if data_batch is None and iterator is not None:
            data_batch = first_data_batch(iterator)
        if data_batch is not None:
            data_batch, _ = split_example_ids(data_batch)
        return super()._symbolic_build(data_batch=data_batch)  # type: ignore[misc]
