"""The example-independence guard on JAX: the same two inference passes, statelessly.

As on TensorFlow (`engine/independence.py`, whose comparison and refusal this
uses: `engine/example_independence.py`), the model runs in inference mode on a
batch and on the same batch with its second half replaced by the first half's
examples reversed; the first half's outputs and per-example losses (the sums of
the weighted values each Keras loss reduces) must not change. Here both passes
run inside a `keras.StatelessScope` mapping the model's variables to the step's
state: whatever a layer or the loss assigns stays in the scope, so no state and
no metric of the model changes, and the weights are those of the step about to run.

Example:

```python
mixing = find_example_mixing(model, state, x, y)     # state: (trainable, non_trainable, ...)
if mixing is not None:
    raise mixing_error(model, mixing)
```
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import keras
import numpy as np
from keras import tree

from keras_gradtrack.backends.jax.losses import per_example_values, recording_losses
from keras_gradtrack.engine.example_independence import Mixing, first_mixing, leading_size


def find_example_mixing(
    model: Any, state: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> Mixing | None:
    """Runs the guard on one batch: `Mixing` where it fails, None where it holds
    (or where a batch of one example leaves nothing to compare).

    Args:
        model: A built Keras model.
        state: The step's state; its first two entries are the values of
            `model.trainable_variables` and `model.non_trainable_variables`.
        x: The batch's inputs (without example ids).
        y: Its targets; with a compiled loss, the per-example losses are compared too.
        sample_weight: Its sample weights, if any.
    """
    size = leading_size(x)
    if size is None or size < 2:
        return None
    kept = size // 2
    mapping = [
        *zip(model.trainable_variables, state[0]),
        *zip(model.non_trainable_variables, state[1]),
    ]
    full = forward(model, mapping, x, y, sample_weight)
    variant = forward(
        model, mapping, *(others_replaced(value, kept) for value in (x, y, sample_weight))
    )
    return first_mixing(full, variant, kept, size)


def forward(
    model: Any, mapping: list[tuple[Any, Any]], x: Any, y: Any, sample_weight: Any
) -> dict[str, np.ndarray]:
    """`{what: (B, ...) values}`: the outputs and, with a compiled loss and targets,
    the per-example sums of the weighted loss values Keras reduces."""
    with keras.StatelessScope(state_mapping=mapping), recording_losses() as recorder:
        y_pred = model(x, training=False)
        if y is not None and model.loss is not None:
            model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    found: dict[str, np.ndarray] = {}
    for index, output in enumerate(tree.flatten(y_pred)):
        if getattr(output, "ndim", 0) and jnp.issubdtype(output.dtype, jnp.floating):
            found[f"output {index}"] = np.asarray(output)
    for index, record in enumerate(recorder.records):
        found[f"loss {index}"] = np.asarray(per_example_values(record))
    return found


def others_replaced(data: Any, kept: int) -> Any:
    """`data` (any structure; None stays None) with its rows from `kept` on replaced by
    its first rows in reverse order (the batch size stays)."""
    if data is None:
        return None

    def replaced(value: Any) -> Any:
        if value is None:
            return None
        value = jnp.asarray(value)
        return jnp.concatenate([value[:kept], jnp.flip(value[: value.shape[0] - kept], axis=0)])

    return tree.map_structure(replaced, data)
