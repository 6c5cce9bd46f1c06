"""Layer calls whose inputs do not depend on the batch, on PyTorch, broadcast to it.

As on TensorFlow and JAX (`backends/ops/batchless.py`): a learned position table's
call has no batch axis, so a tracked step makes it on its input broadcast to the
batch size. Which calls are batchless is read from two inference passes, once per
plan before the first tracked step: one on the batch and one on the batch with one
example more (its first, again); a call whose input keeps its shape does not follow
the batch. Both passes run without gradients inside a `keras.StatelessScope`, so no
state of the model changes.

Example:

```python
batchless = find_batchless_calls(model, probes, x)
with probes.installed(batchless, batch_size):
    ...
```
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch
from keras import tree

from keras_gradtrack.backends.ops.batchless import mixing_rows_error
from keras_gradtrack.backends.torch.probes import Probes


def with_one_example_more(x: Any) -> Any:
    """`x` with its first example again at the end."""
    return tree.map_structure(
        lambda value: value if value is None else torch.cat([value, value[:1]]), x
    )


def input_shape(call_input: Any) -> tuple[int, ...]:
    """The shape of a call's input (a recurrent call's record: its input sequences')."""
    if isinstance(call_input, dict) and "inputs" in call_input:
        call_input = call_input["inputs"]
    return tuple(np.shape(call_input))


def find_batchless_calls(model: Any, probes: Probes, x: Any) -> frozenset[int]:
    """Positions (in call order) of the probed calls whose input does not follow the
    batch size; raises `mixing_rows_error` where broadcasting them changes the model's
    outputs.

    Args:
        model: The model.
        probes: `Probes` of the tracked layers.
        x: The batch's inputs (without example ids), tensors.
    """
    batch_size = int(tree.flatten(x)[0].shape[0])

    def outputs(x: Any, batchless: frozenset[int] = frozenset()) -> tuple[list[Any], list[Any]]:
        mapping = [
            (v, v.value.detach().clone())
            for v in [*model.non_trainable_variables, *model.metrics_variables]
        ]
        with (
            torch.no_grad(),
            keras.StatelessScope(state_mapping=mapping),
            probes.installed(batchless, batch_size),
        ):
            found = tree.flatten(model(x, training=False))
        shapes = [input_shape(call_input) for _, call_input, _ in probes.calls]
        return [np.asarray(value.cpu()) for value in found], shapes

    plain, as_is = outputs(x)
    _, grown = outputs(with_one_example_more(x))
    if len(as_is) != len(grown):
        return frozenset()
    batchless = frozenset(
        position for position, (before, after) in enumerate(zip(as_is, grown)) if before == after
    )
    for position in sorted(batchless):
        broadcast, shapes = outputs(x, frozenset({position}))
        if any(
            a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(plain, broadcast)
        ):
            layer = probes.layers[probes.calls[position][0]]
            raise mixing_rows_error(layer, shapes[position])
    return batchless
