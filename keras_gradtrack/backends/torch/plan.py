"""The PyTorch engine's plan: the shared one (`ops.plan`) with its registry and refusals.

Example:

```python
build_plan(model)[0].path    # "rule:dense"
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.ops.plan import TrackedLayer, planned_layers, refusal
from keras_gradtrack.backends.ops.recurrent import cell_layers, cell_of
from keras_gradtrack.backends.torch.registry import lookup

FALLBACK_PATH = "fallback (per-layer torch.func.vmap of grad)"


def build_plan(model: keras.Model) -> list[TrackedLayer]:
    """The tracked layers of a built model, in column order (`ops.plan.planned_layers`).

    Raises:
        ValueError: For a layer the PyTorch engine refuses (`refusal`: a recurrent
            layer off its rule that the fallback cannot repeat, BatchNormalization
            in training), trainable
            variables of the model itself, or a model without trainable variables.
    """
    return planned_layers(model, lookup, refusal, FALLBACK_PATH, recurrent_cell)


def recurrent_cell(layer: Any) -> tuple[Any, list[Any]]:
    """`(the cell whose variables the layer's column holds, or None; the cell's layers)`."""
    return cell_of(layer), cell_layers(layer)
