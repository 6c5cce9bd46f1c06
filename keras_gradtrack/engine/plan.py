"""Which layers are tracked, and how: the tracking plan of a model."""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack._keras_seam import flatten_layers, own_trainable_variables
from keras_gradtrack.engine.repeatable_calls import unrepeatable_call
from keras_gradtrack.engine.tracked_layer import TrackedLayer, unique_name
from keras_gradtrack.rules import lookup

# Layers whose training-mode output for one example depends on the others.
EXAMPLE_MIXING_LAYERS: tuple[type, ...] = (keras.layers.BatchNormalization,)


def example_mixing_refusal(layer: Any, opted_in: bool = False) -> str:
    """Why the layer cannot be tracked: its training-mode output for one example
    depends on the others and the model did not opt in to that (empty when it can be
    tracked)."""
    mixes_examples = any(isinstance(layer, cls) for cls in EXAMPLE_MIXING_LAYERS)
    if not mixes_examples or not layer.trainable or opted_in:
        return ""
    return (
        f"Layer {layer.name!r} is a {type(layer).__name__} in training mode: it "
        "normalizes with statistics of the whole batch, so example i's loss depends "
        "on the other examples. Choose one:\n"
        "* exact per-example gradients of this model, through the batch statistics "
        "(the other examples held fixed; they sum to the batch gradient): set "
        "`model.track_batch_normalization = True`. A tracked step then costs about "
        "one extra backward pass per example through the layers before the last "
        "BatchNormalization (combine it with every_n_steps);\n"
        "* fine-tuning a trained model: freeze the layer (`layer.trainable = False` "
        "runs it in inference mode with its moving statistics): exact and cheap;\n"
        "* training from scratch with per-example independence (as for differential "
        "privacy): `model = kgt.convert_to_group_normalization(model)` replaces "
        "every BatchNormalization by GroupNormalization (a change of the model), "
        "tracked exactly and cheaply."
    )


def refuse_example_mixing_layers(model: keras.Model) -> None:
    """Raises when a layer mixes examples in training and the model did not opt in to that."""
    opted_in = getattr(model, "track_batch_normalization", False)
    for layer in flatten_layers(model, include_self=False):
        refusal = example_mixing_refusal(layer, opted_in)
        if refusal:
            raise ValueError(refusal)


def layers_with_own_variables(model: keras.Model) -> list[tuple[Any, list[Any]]]:
    """`(layer, its own trainable variables)` for every layer that has some, in the
    order of `model.trainable_variables` (Keras' own order of the model's weights).

    A layer whose rule covers its sublayers (a recurrent layer and its cell) owns
    their variables too; the outermost such layer, when they nest.
    """
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    layers = list(flatten_layers(model, include_self=False))  # outer layers first
    covering = [layer for layer in layers if lookup(layer).covers_sublayers]
    owner: dict[int, Any] = {}
    for layer in covering:
        for v in layer.trainable_variables:
            owner.setdefault(id(v), layer)
    groups = []
    for layer in layers:
        variables = (
            layer.trainable_variables if layer in covering else own_trainable_variables(layer)
        )
        own = [v for v in variables if id(v) in position and owner.get(id(v), layer) is layer]
        if own:
            groups.append((layer, sorted(own, key=lambda v: position[id(v)])))
    return sorted(groups, key=lambda group: position[id(group[1][0])])


Plan = tuple[TrackedLayer, ...]


def build_plan(model: keras.Model) -> Plan:
    """Lists the model's layers that own trainable variables, in column order.

    Raises:
        ValueError: If the model has no trainable weights, holds variables that
            belong to no layer, or has a layer that mixes examples in training.
    """
    refuse_example_mixing_layers(model)
    return tracked_layers(model)


def tracked_layers(model: keras.Model) -> Plan:
    """`build_plan` without refusing the layers that mix examples (for the summary,
    which lists them as refused)."""
    trainable = list(model.trainable_variables)
    if not trainable:
        raise ValueError(
            f"Model {model.name!r} has no trainable weights, so there are no gradients to "
            "track. Received: model.trainable_variables=[]"
        )
    trainable_ids = {id(v) for v in trainable}
    owned_by_model = [v for v in own_trainable_variables(model) if id(v) in trainable_ids]
    if owned_by_model:
        raise ValueError(
            "Variables created directly on the model cannot be tracked per layer; create "
            "them in a layer. Received: "
            f"{[v.path if hasattr(v, 'path') else v.name for v in owned_by_model]}"
        )
    plan: list[TrackedLayer] = []
    used_names: set[str] = set()
    for layer, own in layers_with_own_variables(model):
        found = lookup(layer)
        if found.rule is None and found.covers_sublayers:
            refusal = unrepeatable_call(layer, found.reason)
            if refusal:
                raise ValueError(refusal)
        name = unique_name(layer.name, used_names)
        plan.append(TrackedLayer(name, layer, tuple(own), found.rule, found.reason))
    covered = {id(v) for tracked in plan for v in tracked.variables}
    missing = [v.path if hasattr(v, "path") else v.name for v in trainable if id(v) not in covered]
    if missing:
        raise ValueError(
            f"Some trainable variables belong to no layer of the model: {missing}. "
            "Create them inside a keras.layers.Layer."
        )
    return tuple(plan)
