"""The PyTorch engine's exact per-layer fallback: `torch.func.vmap` of `torch.func.grad`.

A layer without a rule gets example i's gradient of its own variables as `d <z(x_i;
theta), d_i> / d theta`, with `z` the layer's pre-activation output on example i
alone (its `stateless_call` on the step's values) and `d_i` its output gradient: one
layer, never the whole model. A keyword argument with a row per example (a mask)
goes with its example; the others go whole.

Example:

```python
grads = fallback_per_example(layer, values, call)    # one (B, *variable.shape) each
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from keras import tree

from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.backends.ops.rules import ProbedCall


def has_rows(value: Any, batch: int) -> bool:
    """Whether a call's argument holds one row per example."""
    leaves = tree.flatten(value)
    return bool(leaves) and all(
        isinstance(leaf, torch.Tensor) and leaf.ndim >= 1 and leaf.shape[0] == batch
        for leaf in leaves
    )


def fallback_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """Exact per-example gradients of the layer's own variables (see the module).

    Raises:
        ValueError: When the layer's call cannot run under `torch.func.vmap` (it reads
            a tensor's value in Python, say), naming the layer.
    """
    batch = call.inputs.shape[0]
    rows = {k: v for k, v in call.kwargs.items() if has_rows(v, batch)}
    whole = {k: v for k, v in call.kwargs.items() if k not in rows}
    values = [value.detach() for value in values]
    others = [value.detach() for value in others]

    def one_example(x: Any, d: Any, example_rows: Any) -> list[Any]:
        kwargs = {**whole, **tree.map_structure(lambda row: row[None], example_rows)}

        def contracted(trainable: Sequence[Any]) -> Any:
            z = preactivation_call(layer, trainable, others, x[None], kwargs)
            return torch.sum(z.float() * d[None])

        return torch.func.grad(contracted)(values)

    try:
        grads = torch.func.vmap(one_example)(call.inputs.detach(), call.output_grad.float(), rows)
    except Exception as error:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) has no rule, and its call does "
            "not run under torch.func.vmap, which the PyTorch engine's exact per-layer "
            "fallback needs (one example at a time, without a loop over the batch). "
            "Register a rule for it (`kgt.register_rule`, its per_example function in "
            f"keras.ops), or run it on TensorFlow or JAX. Received: {error!r}"
        ) from error
    return [g.float() for g in grads]
