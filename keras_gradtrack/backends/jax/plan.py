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
from keras_gradtrack.backends.ops.plan import TrackedLayer, planned_layers, refusal
from keras_gradtrack.backends.ops.recurrent import cell_layers, cell_of

FALLBACK_PATH = "fallback (per-layer vmap of jax.grad)"
BACKEND = "JAX"


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
