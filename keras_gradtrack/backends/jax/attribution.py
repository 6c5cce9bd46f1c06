"""Attribution on JAX: the targets' pass of the tracked step (`ops/attribution.py` holds the rest).

`target_calls` differentiates the targets' summed per-example losses (the compiled
loss, inference mode, no sample weights) at the step's weights with respect to zero
probes on the tracked layers' outputs, in one `jax.value_and_grad` inside the
compiled step; the products and sketches are the shared ones.

Example:

```python
rows = attribution_rows(model, plan, requests, calls, values, trainable, non_trainable, losses)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_gradtrack.backends.jax.batchless import batchless_calls
from keras_gradtrack.backends.jax.plan import TrackedLayer
from keras_gradtrack.backends.jax.probes import Probes
from keras_gradtrack.backends.jax.rules import f32, fallback_per_example
from keras_gradtrack.backends.ops import attribution as shared
from keras_gradtrack.backends.ops.attribution import called_on_targets
from keras_gradtrack.backends.ops.rules import ProbedCall
from keras_gradtrack.engine.attribution_requests import TargetExamples


def attribution_rows(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    requests: Sequence[Any],
    calls: Sequence[shared.LayerCalls],
    values: Callable[[Any], Any],
    trainable: Sequence[Any],
    non_trainable: Sequence[Any],
    target_losses: Callable[[Any, Any], Any],
) -> dict[str, Any]:
    """`ops.attribution.attribution_rows` with JAX's targets' pass and fallback."""
    return shared.attribution_rows(
        model,
        plan,
        requests,
        calls,
        values,
        trainable,
        non_trainable,
        target_losses,
        target_calls,
        fallback_per_example,
    )


def target_calls(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    targets: TargetExamples,
    trainable: Sequence[Any],
    non_trainable: Sequence[Any],
    target_losses: Callable[[Any, Any], Any],
) -> list[list[ProbedCall]]:
    """Per layer of `plan`, its calls on the targets with the output gradients of each
    target's own loss `l'_j` (the compiled loss in inference mode, no sample weight),
    at the given weights (`target_losses` as for `attribution_rows`)."""
    probes = Probes([tracked.layer for tracked in plan])
    mapping = [
        *zip(model.trainable_variables, trainable),
        *zip(model.non_trainable_variables, non_trainable),
    ]
    x = keras.tree.map_structure(jnp.asarray, targets.x)
    y = keras.tree.map_structure(jnp.asarray, targets.y)
    batchless: frozenset[int] = frozenset()

    def forward(probe_values: Any, data: Any) -> Any:
        x, y = data
        with (
            keras.StatelessScope(state_mapping=mapping),
            probes.installed(probe_values, batchless, len(targets)),
        ):
            prediction = model(x, training=False)
            losses = target_losses(y, prediction)
        inputs = [call_inputs for _, call_inputs, _ in probes.calls]
        return jnp.sum(losses), (inputs, list(probes.probed), probes.call_tensors())

    data = (x, y)
    # Calls on values that do not depend on the batch are made on them broadcast to it.
    batchless = batchless_calls(lambda data: forward(None, data)[1][0], data)
    shapes = jax.eval_shape(lambda data: forward(None, data), data)[1][1]
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    (_, (inputs, _, tensors)), probe_grads = jax.value_and_grad(forward, has_aux=True)(zeros, data)
    kwargs = probes.call_kwargs(tensors)
    per_layer: list[list[ProbedCall]] = [[] for _ in plan]
    for n, (index, call_kwargs) in enumerate(kwargs):
        per_layer[index].append(ProbedCall(inputs[n], call_kwargs, f32(probe_grads[n])))
    return called_on_targets(plan, per_layer)
