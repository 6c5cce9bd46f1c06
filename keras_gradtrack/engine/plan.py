"""Which layers are tracked, and how: the tracking plan of a model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_gradtrack.engine.taps import LayerTap
from keras_gradtrack.rules import Rule, rule_for

FALLBACK_PATH = "fallback (per-layer vectorized Jacobian)"

# Layers whose training-mode output for one example depends on the others.
EXAMPLE_MIXING_LAYERS: tuple[type, ...] = (keras.layers.BatchNormalization,)


@dataclasses.dataclass
class TrackedLayer:
    """One column of the per-layer statistics.

    Attributes:
        name: Column name (the layer's name, made unique within the model).
        layer: The Keras layer.
        variables: The layer's own trainable variables (not its sublayers').
        rule: The rule computing its primitives, or None for the fallback.
        tap: The trace-time tap installed on the layer.
        materialized: Set while a step is traced: whether the rule builds the
            layer's per-example gradients (and the batch gradient is their sum).
    """

    name: str
    layer: Any
    variables: list[Any]
    rule: Rule | None
    tap: LayerTap
    materialized: bool | None = None

    @property
    def form(self) -> str:
        """`materialized`, `direct` (the rule's primitives), `jacobian` (the fallback),
        or `-` before the first traced step."""
        if self.rule is None:
            return "jacobian"
        if self.materialized is None:
            return "-"
        return "materialized" if self.materialized else "direct"

    @property
    def path(self) -> str:
        """How the primitives are computed: `rule:<name>` or the fallback."""
        return f"rule:{self.rule.name}" if self.rule else FALLBACK_PATH

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables)


def refuse_example_mixing_layers(model: keras.Model) -> None:
    """Raises when a layer makes one example's output depend on the others in training."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, EXAMPLE_MIXING_LAYERS) and layer.trainable:
            raise ValueError(
                f"Layer {layer.name!r} is a {type(layer).__name__} in training mode: it "
                "normalizes with statistics of the whole batch, so an example's gradient "
                "depends on the other examples and per-example gradients are not defined. "
                "Use keras.layers.GroupNormalization or LayerNormalization instead, or "
                "freeze the layer (layer.trainable = False runs it in inference mode)."
            )


def layers_with_own_variables(model: keras.Model) -> list[tuple[Any, list[Any]]]:
    """`(layer, its own trainable variables)` for every layer that has some, in model order."""
    trainable_ids = {id(v) for v in model.trainable_variables}
    groups = []
    for layer in model._flatten_layers(include_self=False):
        own = [v for v in layer._trainable_variables if id(v) in trainable_ids]
        if own:
            groups.append((layer, own))
    return groups


def build_plan(model: keras.Model) -> list[TrackedLayer]:
    """Lists the model's layers that own trainable variables, in column order.

    Raises:
        ValueError: If the model has no trainable weights, holds variables that
            belong to no layer, or has a layer that mixes examples in training.
    """
    refuse_example_mixing_layers(model)
    trainable = list(model.trainable_variables)
    if not trainable:
        raise ValueError(
            f"Model {model.name!r} has no trainable weights, so there are no gradients to "
            "track. Received: model.trainable_variables=[]"
        )
    trainable_ids = {id(v) for v in trainable}
    owned_by_model = [v for v in model._trainable_variables if id(v) in trainable_ids]
    if owned_by_model:
        raise ValueError(
            "Variables created directly on the model cannot be tracked per layer; create "
            "them in a layer. Received: "
            f"{[v.path if hasattr(v, 'path') else v.name for v in owned_by_model]}"
        )
    plan: list[TrackedLayer] = []
    used_names: set[str] = set()
    for layer, own in layers_with_own_variables(model):
        rule = rule_for(layer)
        name = unique_name(layer.name, used_names)
        tap = LayerTap(layer, split_activation=rule.split_activation if rule else False)
        plan.append(TrackedLayer(name=name, layer=layer, variables=own, rule=rule, tap=tap))
    covered = {id(v) for tracked in plan for v in tracked.variables}
    missing = [v.path if hasattr(v, "path") else v.name for v in trainable if id(v) not in covered]
    if missing:
        raise ValueError(
            f"Some trainable variables belong to no layer of the model: {missing}. "
            "Create them inside a keras.layers.Layer."
        )
    return plan


# Operations that run another function graph and receive variable handles for it.
FUNCTION_CALL_OPS = frozenset(
    {
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "PartitionedCall",
        "StatefulPartitionedCall",
    }
)


def captured_handle(graph: Any, variable: Any) -> Any:
    """The tensor standing for the variable's resource handle inside `graph`, or None.

    A function graph captures either the handle itself or, when nested, the
    tensor that stands for it in an enclosing function graph.
    """
    value = getattr(variable, "_value", variable)  # the tf.Variable under a Keras one
    handle = getattr(value, "handle", None)

    def inside(graph: Any) -> Any:
        if handle is None or not hasattr(graph, "captures"):
            return None
        candidates = [handle]
        outer = inside(getattr(graph, "outer_graph", None))
        if outer is not None:
            candidates.append(outer)
        for external, internal in graph.captures:
            if any(external is candidate for candidate in candidates):
                return internal
        return None

    return inside(graph)


def refuse_calls_inside_loops(plan: Sequence[TrackedLayer], graph: Any) -> None:
    """Raises when a tracked layer ran inside a loop or function body of the traced step.

    A Keras RNN layer runs its cell in a `tf.while_loop`; the cell's inputs and
    outputs there exist only inside the loop, out of the backward pass' reach.
    """
    for tracked in plan:
        for call in tracked.tap.calls:
            if graph is not None and call.graph is not graph:
                raise ValueError(
                    f"Layer {tracked.layer.name!r} ({type(tracked.layer).__name__}) runs "
                    "inside a loop of the traced step (a Keras RNN layer runs its cell in "
                    "a tf.while_loop), where its per-example gradients cannot be taken. "
                    "Pass unroll=True to the RNN layer: its cell is then called once per "
                    "time step and tracked exactly (on the fallback path)."
                )


def refuse_tied_variables(plan: Sequence[TrackedLayer], forward: range) -> None:
    """Raises when a tracked layer's variable is used in the forward pass outside that layer.

    Args:
        plan: The tracking plan, its taps holding this trace's calls.
        forward: Positions of the forward pass' operations in the graph being
            traced (empty when run eagerly: nothing is checked).

    The rules and the fallback see a layer's variables only through the
    layer's own calls; a variable also read elsewhere (weight tying) would get
    per-example gradients that miss that use.
    """
    if not forward:
        return
    graph = tf.compat.v1.get_default_graph()
    owners: dict[str, tuple[TrackedLayer, Any]] = {}
    for tracked in plan:
        for variable in tracked.variables:
            handle = captured_handle(graph, variable)
            if handle is not None:
                owners[handle.name] = (tracked, variable)
    own_ops = {
        id(tracked): {index for call in tracked.tap.calls for index in call.graph_ops}
        for tracked in plan
    }
    operations = graph.get_operations()
    for index in forward:
        op = operations[index]
        if op.type in FUNCTION_CALL_OPS:
            # Its body (a loop of an RNN layer, say) is another graph, where the calls
            # of the layers inside were recorded: no use here to attribute.
            continue
        for tensor in op.inputs:
            owner = owners.get(tensor.name)
            if owner is not None and index not in own_ops[id(owner[0])]:
                tracked, variable = owner
                raise ValueError(
                    f"Variable {variable.path!r} of layer {tracked.layer.name!r} is also used "
                    f"outside that layer's call (by operation {op.name!r}): tied weights. "
                    "Per-example gradients are computed per layer, from each layer's own "
                    "calls, so they would miss that use. Give each use its own variable, "
                    "or call the owning layer for every use."
                )


def unique_name(name: str, used: set[str]) -> str:
    candidate, suffix = name, 1
    while candidate in used:
        candidate = f"{name}_{suffix}"
        suffix += 1
    used.add(candidate)
    return candidate


def format_summary(plan: Sequence[TrackedLayer]) -> str:
    """A table of the tracked layers: column, class, parameters, path."""
    rows = [("column", "layer", "class", "params", "path", "form")]
    for index, tracked in enumerate(plan):
        rows.append(
            (
                str(index),
                tracked.name,
                type(tracked.layer).__name__,
                str(tracked.num_parameters),
                tracked.path,
                tracked.form,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    fallbacks = sum(1 for tracked in plan if tracked.rule is None)
    lines.append(f"{len(plan)} tracked layers, {fallbacks} on the fallback path")
    return "\n".join(line.rstrip() for line in lines)
