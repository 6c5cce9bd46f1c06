"""Targets chosen after training on JAX: their gradient sketches at a model's weights.

`keras_gradtrack.attribution.estimate_influence` pairs each logged row's sketch with
the targets' sketches at the last checkpoint before its step; on JAX the targets'
sketches come from here: the targets' pass of the tracked step
(`attribution.target_calls`, compiled loss, inference mode) and the same sketches
(`attribution.sketches`, the log's projections), jitted once and run at each
checkpoint's weights (`keras_gradtrack/attribution/checkpoint_sketches.py`).

Example:

```python
compute = sketch_function(model, build_plan(model), 16, 0, targets)
compute()    # (T, K) at the model's current weights
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras

from keras_gradtrack.backends.jax.attribution import lazy_per_example, sketches, target_calls
from keras_gradtrack.backends.jax.plan import TrackedLayer
from keras_gradtrack.backends.jax.step import per_example_losses, variable_values
from keras_gradtrack.engine.attribution_requests import SketchRequest, TargetExamples


def sketch_function(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    dim: int,
    seed: int,
    targets: TargetExamples,
) -> Callable[[], Any]:
    """The JAX engine's `SketchFunction` (`attribution/checkpoint_sketches.py`): the
    targets' pass and sketches, jitted once, run on the model's variables' values when
    it is called."""
    request = SketchRequest(dim, seed)

    def target_losses(y: Any, y_pred: Any) -> Any:
        return per_example_losses(model, y, y_pred, None)[0]

    @jax.jit
    def compute(trainable: Any, non_trainable: Any) -> Any:
        value = variable_values(model, trainable, non_trainable)
        calls = target_calls(model, plan, targets, trainable, non_trainable, target_losses)
        return sketches(plan, calls, request, value, lazy_per_example(plan, calls, value))

    def at_current_weights() -> Any:
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return compute(trainable, non_trainable)

    return at_current_weights
