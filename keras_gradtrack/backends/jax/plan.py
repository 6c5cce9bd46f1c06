"""Which layers the JAX engine tracks, and what it refuses before training.

Example:

```python
plan = build_plan(model)
[tracked.name for tracked in plan]    # the per-layer columns
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.jax.registry import lookup
from keras_gradtrack.backends.ops.plan import TrackedLayer, planned_layers
from keras_gradtrack.backends.ops.recurrent import cell_layers, cell_of, recurrent_refusal

FALLBACK_PATH = "fallback (per-layer vmap of jax.grad)"
BACKEND = "JAX"


def refusal(layer: Any, track_batch_normalization: bool = False) -> str:
    """Why the JAX engine cannot track the layer yet (empty when it can; a trainable
    BatchNormalization can be, when the model opts in: `backends/jax/coupled.py`)."""
    name = f"Layer {layer.name!r} ({type(layer).__name__})"
    if isinstance(layer, keras.layers.RNN):
        return recurrent_refusal(layer)
    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
        if track_batch_normalization:
            return ""
        return (
            f"{name} normalizes with statistics of the whole batch in training, so example "
            "i's loss depends on the other examples. For exact per-example gradients "
            "through the batch statistics (the other examples held fixed), set "
            "`model.track_batch_normalization = True` (about one extra backward pass per "
            "example through the layers before the last BatchNormalization); or freeze it "
            "(`layer.trainable = False`: exact and cheap), or replace it with "
            "GroupNormalization (`kgt.convert_to_group_normalization`)."
        )
    return ""


def build_plan(model: keras.Model) -> list[TrackedLayer]:
    """The tracked layers of a built model, in column order (`ops.plan.planned_layers`).

    Raises:
        ValueError: For a layer the JAX engine refuses (recurrent layers off their
            rule, BatchNormalization in training unless the model opts in, activity
            regularizers), trainable variables of the model itself, or a model without
            trainable variables.
    """
    return planned_layers(model, lookup, refusal, FALLBACK_PATH, recurrent_cell)


def recurrent_cell(layer: Any) -> tuple[Any, list[Any]]:
    """`(the cell whose variables the layer's column holds, or None; the cell's layers)`."""
    return cell_of(layer), cell_layers(layer)
