"""Examples' gradient sketches at a model's weights, on JAX.

`keras_gradtrack.attribution.estimate_influence` pairs each logged row's sketch with
the targets' sketches at the last checkpoint before its step, and
`keras_gradtrack.attribution.sketch_examples` returns examples' sketches at each
checkpoint; on JAX both come from here: the targets' pass of the tracked step
(`attribution.target_calls`, compiled loss, inference mode) and the same sketches
(`ops.attribution.sketches`, the log's projections), jitted once per shape of the examples
and run at each checkpoint's weights (`keras_gradtrack/attribution/checkpoint_sketches.py`).

Example:

```python
compute = sketch_function(model, build_plan(model), 16, 0)
compute(x, y, None)    # (n, K) at the model's current weights
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras

from keras_gradtrack.backends.jax.attribution import target_calls
from keras_gradtrack.backends.jax.plan import TrackedLayer
from keras_gradtrack.backends.jax.rules import fallback_per_example
from keras_gradtrack.backends.ops.attribution import lazy_per_example, sketches
from keras_gradtrack.backends.ops.step import per_example_losses, variable_values
from keras_gradtrack.engine.attribution_requests import SketchRequest


@dataclasses.dataclass(frozen=True)
class Examples:
    """Examples as `target_calls` reads them (`x`, `y`, their count), in a jitted call."""

    x: Any
    y: Any

    def __len__(self) -> int:
        return int(keras.tree.flatten(self.x)[0].shape[0])


def sketch_function(
    model: keras.Model, plan: Sequence[TrackedLayer], dim: int, seed: int
) -> Callable[..., Any]:
    """The JAX engine's `SketchFunction` (`attribution/checkpoint_sketches.py`): the
    examples' pass and sketches, jitted once per shape of the examples, run on the
    model's variables' values when it is called."""
    request = SketchRequest(dim, seed)

    @jax.jit
    def compute(trainable: Any, non_trainable: Any, x: Any, y: Any, sample_weight: Any) -> Any:
        # The sample weights travel with the labels: `target_calls` also traces the pass
        # on one example more, to find the calls that do not follow the batch.
        def losses(labels: Any, y_pred: Any) -> Any:
            y, sample_weight = labels if weighted else (labels, None)
            return per_example_losses(model, y, y_pred, sample_weight)[0]

        weighted = sample_weight is not None
        labels = (y, sample_weight) if weighted else y
        value = variable_values(model, trainable, non_trainable)
        examples: Any = Examples(x, labels)  # what `target_calls` reads of `TargetExamples`
        calls = target_calls(model, plan, examples, trainable, non_trainable, losses)
        per_example = lazy_per_example(plan, calls, value, fallback_per_example)
        return sketches(plan, calls, request, value, per_example)

    def at_current_weights(x: Any, y: Any, sample_weight: Any) -> Any:
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return compute(trainable, non_trainable, x, y, sample_weight)

    return at_current_weights
