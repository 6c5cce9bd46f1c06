"""Which layers the JAX engine tracks, and what it refuses before training.

Example:

```python
plan = build_plan(model)
[tracked.name for tracked in plan]    # the per-layer columns
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_gradtrack._keras_seam import flatten_layers, own_trainable_variables
from keras_gradtrack.backends.jax.recurrent import cell_layers, cell_of, recurrent_refusal
from keras_gradtrack.backends.jax.registry import lookup
from keras_gradtrack.backends.jax.rules import JaxRule

FALLBACK_PATH = "fallback (per-layer vmap of jax.grad)"
BACKEND = "JAX"


@dataclasses.dataclass(frozen=True)
class TrackedLayer:
    """One column of the per-layer statistics.

    Attributes:
        name: Column name (the layer's name, made unique within the model).
        layer: The Keras layer.
        variables: The layer's own trainable variables.
        rule: Its rule, or None for the exact per-layer fallback.
    """

    name: str
    layer: Any
    variables: tuple[Any, ...]
    rule: JaxRule | None

    @property
    def path(self) -> str:
        return f"rule:{self.rule.name}" if self.rule else FALLBACK_PATH


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
    if getattr(layer, "activity_regularizer", None) is not None and own_trainable_variables(layer):
        return (
            f"{name} has an activity regularizer, a penalty on its output that mixes into "
            "the output gradients; the JAX backend does not track such layers yet."
        )
    return ""


def build_plan(model: keras.Model) -> list[TrackedLayer]:
    """The tracked layers of a built model, in column order.

    Raises:
        ValueError: For a layer the JAX engine refuses (recurrent layers off their
            rule, BatchNormalization in training unless the model opts in, activity
            regularizers), trainable
            variables of the model itself, or a model without trainable variables.
    """
    if own_trainable_variables(model):
        raise ValueError(
            f"Model {model.name!r} holds trainable variables of its own (not in a layer): "
            "the JAX backend tracks the variables of layers. Move them into a layer."
        )
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    groups = []
    cells: set[int] = set()  # those whose variables their recurrent layer's column holds
    opted_in = bool(getattr(model, "track_batch_normalization", False))
    for layer in flatten_layers(model, include_self=False):
        reason = refusal(layer, opted_in)
        if reason:
            raise ValueError(reason)
        if id(layer) in cells:
            continue
        cell = cell_of(layer)
        cells.update(id(inner) for inner in cell_layers(layer))
        variables = own_trainable_variables(layer) if cell is None else cell.trainable_variables
        own = [v for v in variables if id(v) in position]
        if own:
            groups.append((layer, sorted(own, key=lambda v: position[id(v)])))
    # Columns in Keras' own order of the model's weights, as on TensorFlow.
    groups.sort(key=lambda group: position[id(group[1][0])])
    plan: list[TrackedLayer] = []
    used: set[str] = set()
    for layer, own in groups:
        name, suffix = layer.name, 1
        while name in used:
            name, suffix = f"{layer.name}_{suffix}", suffix + 1
        used.add(name)
        plan.append(TrackedLayer(name, layer, tuple(own), lookup(layer)))
    if not plan:
        raise ValueError(f"Model {model.name!r} has no trainable variables to track.")
    return plan
