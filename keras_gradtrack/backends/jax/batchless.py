"""Layer calls whose inputs do not depend on the batch, on JAX, broadcast to it.

A learned position table (`pos_emb(ops.arange(maxlen))`) gives the same value to
every example: the call has no batch axis, and the gradient at its output is the
sum over the batch. As on TensorFlow (`keras_gradtrack/engine/batchless.py`), a
tracked step makes such a call on its input broadcast to the batch size, so its
outputs carry one row per example (the same values in every row), the probe's
gradient is example i's output gradient at those positions, and the layer's rule
(or the fallback) applies unchanged.

Whether a call is batchless is read from two abstract traces of the forward pass
(`jax.eval_shape`, no computation): one with the batch as it is and one with one
example more. A call whose input keeps its shape does not follow the batch (the
batch size alone cannot tell a sequence of length B from a batch of B; two sizes
can). Values outside the call do not change, provided the outputs reach the
batch row by row (`x + positions`): `refuse_batchless_outputs_mixing_rows`
compares the model's outputs with and without the broadcast once, before the
first tracked step, and refuses a model where they differ.

Example:

```python
batchless = batchless_calls(lambda data: inputs_of_probed_calls(data), data)
with probes.installed(values, batchless, batch_size):
    ...
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras
import numpy as np
from keras import tree

from keras_gradtrack.backends.ops.batchless import mixing_rows_error


def with_one_example_more(data: Any) -> Any:
    """Abstract `data` whose batch axis holds one example more."""

    def grown(value: Any) -> Any:
        if value is None:
            return None
        shape = tuple(np.shape(value))
        dtype = jax.dtypes.canonicalize_dtype(np.result_type(value))
        if not shape:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct((shape[0] + 1, *shape[1:]), dtype)

    return tree.map_structure(grown, data)


def batchless_calls(inputs_of: Callable[[Any], Sequence[Any]], data: Any) -> frozenset[int]:
    """Positions of the probed calls whose input does not follow the batch size.

    Args:
        inputs_of: data -> the first argument of each probed call, in call order
            (traced abstractly, twice).
        data: The step's data.
    """
    as_is = jax.eval_shape(inputs_of, data)
    grown = jax.eval_shape(inputs_of, with_one_example_more(data))
    if len(as_is) != len(grown):
        return frozenset()
    return frozenset(
        position
        for position, (before, after) in enumerate(zip(as_is, grown))
        if hasattr(before, "shape") and tuple(before.shape) == tuple(after.shape)
    )


def refuse_batchless_outputs_mixing_rows(
    model: Any, probes: Any, state: Any, x: Any, batch_size: int
) -> None:
    """Raises when broadcasting the model's batchless calls changes its outputs (their
    outputs reach the batch through an operation that mixes rows: a reduction or
    reshape over the broadcast axis), naming the first such layer.

    Args:
        model: The model.
        probes: `Probes` of the tracked layers.
        state: The step's state (trainable and non-trainable values first).
        x: The batch's inputs (without example ids).
        batch_size: The number of examples in `x`.
    """
    mapping = [
        *zip(model.trainable_variables, state[0]),
        *zip(model.non_trainable_variables, state[1]),
    ]

    def outputs(x: Any, batchless: frozenset[int] = frozenset()) -> Any:
        with (
            keras.StatelessScope(state_mapping=mapping),
            probes.installed(None, batchless, batch_size),
        ):
            return model(x, training=False)

    def inputs_of(x: Any) -> list[Any]:
        outputs(x)
        return [call_input for _, call_input, _ in probes.calls]

    batchless = batchless_calls(inputs_of, x)
    if not batchless:
        return
    plain = tree.flatten(outputs(x))
    for position in sorted(batchless):
        broadcast = tree.flatten(outputs(x, frozenset({position})))
        if any(
            np.shape(a) != np.shape(b) or not np.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(plain, broadcast)
        ):
            layer = probes.layers[probes.calls[position][0]]
            raise mixing_rows_error(layer, tuple(np.shape(probes.calls[position][1])))
