"""Per-output-feature weight gradients on JAX (`OutputGradientLogger`): one jitted
forward pass (`stateless_call` at the variables' current values) and `jax.vjp` pulled
back once per feature of the chunk, one after another (`jax.lax.map`).

Example:

```python
gradients = output_gradients(model, variables, axis=-1, chunk_size=4)
for features, grads in gradients(x):
    ...
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_gradtrack.backends.ops.output_gradients import OutputGradients, feature_cotangent


def output_gradients(
    model: Any, variables: Sequence[Any], axis: int, chunk_size: int
) -> OutputGradients:
    """`OutputGradients` of `model`'s output features with respect to `variables` (some
    of its trainable variables)."""
    trainable = list(model.trainable_variables)
    index = {id(v): i for i, v in enumerate(trainable)}
    positions = [index[id(v)] for v in variables]

    @jax.jit
    def chunk_grads(trainable_values: Any, non_trainable: Any, x: Any, features: Any) -> Any:
        def output(selected: list[Any]) -> Any:
            values = list(trainable_values)
            for position, value in zip(positions, selected):
                values[position] = value
            y, _ = model.stateless_call(values, non_trainable, x)
            return y

        y, pull_back = jax.vjp(output, [trainable_values[p] for p in positions])
        feature_axis = axis % y.ndim

        def one(feature: Any) -> Any:
            cotangent = feature_cotangent(y.shape, feature_axis, feature, jnp)
            return pull_back(cotangent.astype(y.dtype))[0]

        return jax.lax.map(one, features), y.shape[feature_axis]

    def chunk(x: Any, features: np.ndarray) -> tuple[Sequence[Any], int]:
        # Inside `fit` Keras keeps the values in its state: a callback syncs them back.
        model.jax_state_sync()
        grads, num_features = chunk_grads(
            [v.value for v in trainable],
            [v.value for v in model.non_trainable_variables],
            x,
            jnp.asarray(features, jnp.int32),
        )
        return grads, int(num_features)

    return OutputGradients(chunk, chunk_size)
