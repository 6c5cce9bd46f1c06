"""Attribution on PyTorch: the targets' pass (`ops/attribution.py` holds the rest).

`target_calls` runs the model on the targets in inference mode (`training=False`) at
the step's weights before its update, with the probes on the tracked layers, inside
a `keras.StatelessScope` (no state changes), and differentiates the targets' summed
per-example losses (the compiled loss, no sample weights) with respect to the
probed outputs in one `torch.autograd.grad`; the products with the batch's
gradients and the sketches are the shared ones. `sketch_function` gives examples'
sketches at a checkpoint's weights (`estimate_influence`, `sketch_examples`).

Example:

```python
calls = target_calls(model, plan, targets, trainable, non_trainable, losses)
calls[0][0].output_grad    # (T, ...) d l'_j / d z_j of the first layer's call
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import torch
from keras import ops

from keras_gradtrack.backends.ops.attribution import called_on_targets, lazy_per_example, sketches
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.rules import ProbedCall
from keras_gradtrack.backends.ops.step import per_example_losses
from keras_gradtrack.backends.torch.batchless import find_batchless_calls
from keras_gradtrack.backends.torch.fallback import fallback_per_example
from keras_gradtrack.backends.torch.forward import detached
from keras_gradtrack.backends.torch.probes import Probes
from keras_gradtrack.engine.attribution_requests import SketchRequest


def target_calls(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    targets: Any,
    trainable: Sequence[Any],
    non_trainable: Sequence[Any],
    target_losses: Callable[[Any, Any], Any],
) -> list[list[ProbedCall]]:
    """Per layer of `plan`, its calls on the targets (`targets.x`, `targets.y`) with the
    output gradients of each target's own loss `l'_j` (`target_losses(y, y_pred)`, the
    compiled loss in inference mode), at the model's current weights (`trainable`, the
    step's values before its update, are those) and non-trainable values.

    Raises:
        ValueError: When the pass on the targets does not call a tracked layer.
    """
    del trainable  # the variables' own values: the backward pass reaches their outputs
    probes = Probes([tracked.layer for tracked in plan])
    x = keras.tree.map_structure(ops.convert_to_tensor, targets.x)
    y = keras.tree.map_structure(ops.convert_to_tensor, targets.y)
    batchless = targets_batchless_calls(model, plan, probes, x)
    mapping = [(v, v.value) for v in model.trainable_variables] + [
        (v, value.detach().clone())
        for v, value in zip(model.non_trainable_variables, non_trainable)
    ]
    with (
        torch.enable_grad(),
        keras.StatelessScope(state_mapping=mapping),
        probes.installed(batchless, len(keras.tree.flatten(x)[0])),
    ):
        losses = target_losses(y, model(x, training=False))
        grads = torch.autograd.grad(ops.sum(losses), probes.probed, allow_unused=True)
    per_layer: list[list[ProbedCall]] = [[] for _ in plan]
    for (index, inputs, kwargs), probe, grad in zip(probes.calls, probes.probed, grads):
        output_grad = torch.zeros_like(probe) if grad is None else grad
        per_layer[index].append(ProbedCall(detached(inputs), kwargs, output_grad.float()))
    return called_on_targets(plan, per_layer)


def targets_batchless_calls(
    model: keras.Model, plan: Sequence[TrackedLayer], probes: Probes, x: Any
) -> frozenset[int]:
    """`find_batchless_calls` on the targets, kept on the model per plan and shapes of
    the targets' inputs: the search runs the model two or three times, and the
    targets' pass runs on every tracked step with targets."""
    key = (
        tuple(id(tracked.layer) for tracked in plan),
        tuple((tuple(t.shape), str(t.dtype)) for t in keras.tree.flatten(x)),
    )
    kept = model.__dict__.setdefault("_targets_batchless_calls", {})
    if key not in kept:
        kept[key] = find_batchless_calls(model, probes, x)
    return kept[key]


class Examples:
    """Examples as `target_calls` reads them (`x`, `y`)."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y


def sketch_function(
    model: keras.Model, plan: Sequence[TrackedLayer], dim: int, seed: int
) -> Callable[..., Any]:
    """The PyTorch engine's `SketchFunction` (`attribution/checkpoint_sketches.py`): the
    examples' pass and sketches at the model's current weights, `(n, K)` float32."""
    request = SketchRequest(dim, seed)

    def at_current_weights(x: Any, y: Any, sample_weight: Any) -> Any:
        x, y, sample_weight = (
            None if value is None else keras.tree.map_structure(ops.convert_to_tensor, value)
            for value in (x, y, sample_weight)
        )

        def losses(labels: Any, y_pred: Any) -> Any:
            return per_example_losses(model, labels, y_pred, sample_weight)[0]

        values = {id(v): v.value.detach() for v in model.variables}
        non_trainable = [v.value for v in model.non_trainable_variables]
        calls = target_calls(model, plan, Examples(x, y), [], non_trainable, losses)
        with torch.no_grad():
            value = values.__getitem__
            per_example = lazy_per_example(
                plan, calls, lambda v: value(id(v)), fallback_per_example
            )
            found = sketches(plan, calls, request, lambda v: value(id(v)), per_example)
        return ops.convert_to_numpy(found)

    return at_current_weights
