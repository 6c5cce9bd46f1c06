"""The PyTorch engine's plan: the shared one (`ops.plan`) with its registry and refusals.

Example:

```python
build_plan(model)[0].path    # "rule:dense"
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.ops.plan import TrackedLayer, planned_layers
from keras_gradtrack.backends.ops.recurrent import cell_layers, cell_of, recurrent_refusal
from keras_gradtrack.backends.torch.registry import lookup

FALLBACK_PATH = "fallback (per-layer torch.func.vmap of grad)"


def refusal(layer: Any, track_batch_normalization: bool = False) -> str:
    """Why the PyTorch engine cannot track the layer yet (empty when it can)."""
    name = f"Layer {layer.name!r} ({type(layer).__name__})"
    if isinstance(layer, keras.layers.RNN):
        return recurrent_refusal(layer)
    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
        return (
            f"{name} normalizes with statistics of the whole batch in training, so example "
            "i's loss depends on the other examples; the PyTorch engine does not track "
            "through it yet (`track_batch_normalization` is TensorFlow's and JAX's). Freeze "
            "it (`layer.trainable = False`: exact and cheap), or replace it with "
            "GroupNormalization (`kgt.convert_to_group_normalization`)."
        )
    return ""


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
