"""Which layers a probed engine (JAX, PyTorch) tracks, in column order.

A backend gives its registry's `lookup`, its refusals and how its fallback is named;
the plan is the same on every backend: one column per layer with trainable variables
of its own (a recurrent layer's column holds its cell's), in Keras' order of the
model's weights, as on TensorFlow.

Example:

```python
plan = planned_layers(model, lookup, refusal, "fallback (torch.func)")
[tracked.name for tracked in plan]    # the per-layer columns
```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from keras_gradtrack._keras_seam import flatten_layers, own_trainable_variables
from keras_gradtrack.backends.ops.recurrent import recurrent_refusal
from keras_gradtrack.backends.ops.rules import ProbedRule, backend_name
from keras_gradtrack.engine.tracked_layer import TrackedLayer, unique_name


def refusal(layer: Any, track_batch_normalization: bool = False) -> str:
    """Why a probed engine cannot track the layer yet (empty when it can): a recurrent
    layer off its rule, or a trainable BatchNormalization unless the model opts in
    (each backend's `coupled.py`)."""
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


def activity_regularizer_refusal(layer: Any) -> str:
    """Why a layer with an activity regularizer is not tracked (empty without one)."""
    if getattr(layer, "activity_regularizer", None) is None or not own_trainable_variables(layer):
        return ""
    return (
        f"Layer {layer.name!r} ({type(layer).__name__}) has an activity regularizer, a "
        "penalty on its output that mixes into the output gradients; the "
        f"{backend_name()} backend does not track such layers yet."
    )


def no_cell(layer: Any) -> tuple[Any, Sequence[Any]]:
    """A backend without recurrent rules: no layer holds a cell's variables."""
    return None, ()


def planned_layers(
    model: keras.Model,
    lookup: Callable[[Any], ProbedRule | None],
    refusal: Callable[[Any, bool], str],
    fallback: str,
    cell: Callable[[Any], tuple[Any, Sequence[Any]]] = no_cell,
) -> list[TrackedLayer]:
    """The tracked layers of a built model, in column order.

    Args:
        model: The model.
        lookup: The backend's registry: a layer's rule, or None (the fallback).
        refusal: `(layer, tracks BatchNormalization) -> why the backend cannot track
            it` (empty when it can); an activity regularizer is refused on every one.
        fallback: The fallback's name in the layers' paths.
        cell: `layer -> (its cell whose variables its column holds, or None; the cell's
            layers)`.

    Raises:
        ValueError: For a layer the backend refuses, trainable variables of the model
            itself, or a model without trainable variables.
    """
    if own_trainable_variables(model):
        raise ValueError(
            f"Model {model.name!r} holds trainable variables of its own (not in a layer): "
            f"the {backend_name()} backend tracks the variables of layers. Move "
            "them into a layer."
        )
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    groups = []
    cells: set[int] = set()  # those whose variables their recurrent layer's column holds
    opted_in = bool(getattr(model, "track_batch_normalization", False))
    for layer in flatten_layers(model, include_self=False):
        reason = activity_regularizer_refusal(layer) or refusal(layer, opted_in)
        if reason:
            raise ValueError(reason)
        if id(layer) in cells:
            continue
        own_cell, inner = cell(layer)
        cells.update(id(layer) for layer in inner)
        variables = (
            own_trainable_variables(layer) if own_cell is None else own_cell.trainable_variables
        )
        own = [v for v in variables if id(v) in position]
        if own:
            groups.append((layer, sorted(own, key=lambda v: position[id(v)])))
    # Columns in Keras' own order of the model's weights, as on TensorFlow.
    groups.sort(key=lambda group: position[id(group[1][0])])
    plan: list[TrackedLayer] = []
    used: set[str] = set()
    for layer, own in groups:
        name = unique_name(layer.name, used)
        plan.append(TrackedLayer(name, layer, tuple(own), lookup(layer), fallback=fallback))
    if not plan:
        raise ValueError(f"Model {model.name!r} has no trainable variables to track.")
    return plan


def plan_summary(
    plan: Sequence[TrackedLayer],
    path_of: Callable[[TrackedLayer], str],
    print_fn: Callable[[str], Any] | None = None,
    notes: Sequence[str] = (),
) -> str:
    """Prints (and returns) the plan as a table: column, layer, class, parameters and the
    path (`path_of`) that computes each layer's per-example gradients; `notes` below it
    (how the engine runs the tracked steps, where that differs from Keras' step)."""
    rows = [("column", "layer", "class", "params", "path")]
    for column, tracked in enumerate(plan):
        params = sum(math.prod(v.shape) for v in tracked.variables)
        rows.append(
            (str(column), tracked.name, type(tracked.layer).__name__, str(params), path_of(tracked))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join([*lines, *notes])
    (print_fn or print)(text)
    return text
