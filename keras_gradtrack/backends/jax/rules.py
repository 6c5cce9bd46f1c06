"""The JAX engine's part of the per-layer rules: the exact per-layer fallback.

The rules themselves are `keras.ops` (`backends/ops/`), shared with the PyTorch
engine. A layer without a rule runs on `fallback_per_example`: the exact
per-example gradient of that layer alone, `jax.vmap(jax.grad)` over its inputs
and output gradients (never the whole model).

Example:

```python
fallback_per_example(layer, values, call)   # one (B, *variable.shape) per variable
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from keras_gradtrack.backends.ops import rules as ops_rules
from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.backends.ops.rules import ProbedCall, ProbedRule


def f32(value: Any) -> Any:
    return jnp.asarray(value, jnp.float32)


def fallback_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """Exact per-example gradients of the layer's own variables: `vmap(grad)` of the layer alone.

    Example i's gradient is `d <z(x_i; theta), d_i> / d theta`, with `z` the
    layer's pre-activation output on example i alone and `d_i` its output gradient.
    A keyword argument with a row per example (a recurrent layer's `mask` and
    `initial_state`) goes with its example; the others go whole.
    """
    batch = call.inputs.shape[0]
    rows = {k: v for k, v in call.kwargs.items() if has_rows(v, batch)}
    whole = {k: v for k, v in call.kwargs.items() if k not in rows}

    def one_example(x: Any, d: Any, example_rows: Any) -> list[Any]:
        kwargs = {**whole, **jax.tree.map(lambda row: row[None], example_rows)}

        def contracted(trainable: Sequence[Any]) -> Any:
            z = preactivation_call(layer, trainable, others, x[None], kwargs)
            return jnp.sum(f32(z) * d[None])

        return jax.grad(contracted)(list(values))

    grads = jax.vmap(one_example)(call.inputs, f32(call.output_grad), rows)
    return [f32(g) for g in grads]


def has_rows(value: Any, batch: int) -> bool:
    """Whether a call's argument holds one row per example: a tensor, or a structure of
    tensors, each with `batch` rows."""
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(
        getattr(leaf, "ndim", 0) >= 1 and leaf.shape[0] == batch for leaf in leaves
    )


def summed_per_example(
    layer: Any,
    rule: ProbedRule | None,
    values: Sequence[Any],
    calls: Sequence[ProbedCall],
    others: Sequence[Any] = (),
) -> list[Any]:
    """The layer's per-example gradients in the step (`ops.rules.summed_per_example`),
    the layers without a rule on `fallback_per_example`."""
    return ops_rules.summed_per_example(layer, rule, values, calls, others, fallback_per_example)
