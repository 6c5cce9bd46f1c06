"""Trace-time checks of a tracked step: what would make a per-example number wrong.

Each raises before any weight changes, naming the layer or variable and the way out.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack._keras_seam import flatten_layers, layer_losses, tf_variable
from keras_gradtrack.engine.plan import TrackedLayer
from keras_gradtrack.engine.taps import RecordedCall

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
    value = tf_variable(variable)
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


def refuse_calls_inside_loops(
    plan: Sequence[TrackedLayer], recorded: Sequence[Sequence[RecordedCall]], graph: Any
) -> None:
    """Raises when a tracked layer ran inside a loop or function body of the traced step.

    The inputs and outputs of a call inside a `tf.while_loop` (or `tf.map_fn`,
    `tf.scan`) exist only inside the loop, out of the backward pass' reach. Keras'
    recurrent layers are tracked whole, loop included (their column holds their
    cell's variables), so this concerns loops written in a layer's own `call`.
    """
    for tracked, calls in zip(plan, recorded):
        for call in calls:
            if graph is not None and call.graph is not graph:
                raise ValueError(
                    f"Layer {tracked.layer.name!r} ({type(tracked.layer).__name__}) runs "
                    "inside a loop of the traced step (a tf.while_loop, tf.map_fn or tf.scan "
                    "in another layer's call), where its per-example gradients cannot be "
                    "taken. Call it outside the loop, or make the layer that runs the loop "
                    "a keras.layers.RNN (its cell then runs in the loop and the RNN layer is "
                    "tracked whole), or register a rule for that layer with "
                    "covers_sublayers=True (keras_gradtrack.register_rule)."
                )


def refuse_tied_variables(
    plan: Sequence[TrackedLayer], own_ops: Sequence[Sequence[range]], forward: range
) -> None:
    """Raises when a tracked layer's variable is used in the forward pass outside that layer.

    Args:
        plan: The tracking plan.
        own_ops: Per tracked layer, the ranges of graph operations that may use its
            variables (its calls in this trace, the weight-regularization penalties).
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
    own = {
        id(tracked): {index for ops in ranges for index in ops}
        for tracked, ranges in zip(plan, own_ops)
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
            if owner is not None and index not in own[id(owner[0])]:
                tracked, variable = owner
                raise ValueError(
                    f"Variable {variable.path!r} of layer {tracked.layer.name!r} is also used "
                    f"outside that layer's call (by operation {op.name!r}): tied weights. "
                    "Per-example gradients are computed per layer, from each layer's own "
                    "calls, so they would miss that use. Give each use its own variable, "
                    "or call the owning layer for every use."
                )


def refuse_activation_losses(model: Any) -> None:
    """Raises when a loss term added in `call` (activity regularization, `add_loss`)
    depends on activations, with the way out that fits the term.

    Such a term is added to the batch loss as one number: it reaches the taps'
    gradients but belongs to no example.
    """
    for layer in flatten_layers(model):
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(activity_regularizer_error(layer))
        if layer_losses(layer):
            raise ValueError(added_loss_error(layer))


def activity_regularizer_error(layer: Any) -> str:
    return (
        f"Layer {layer.name!r} ({type(layer).__name__}) has an activity regularizer "
        f"({type(layer.activity_regularizer).__name__}): Keras adds its value on the "
        "batch's activations to the loss as one number, which belongs to no example, so "
        "per-example gradients cannot include it. Put the term into each example's loss "
        "instead (as for PointNet's orthogonality term): drop `activity_regularizer=`, "
        "compute the penalty of each example's activations in a train_step of your own "
        "and pass `per_example_loss=data_loss + penalty` (shape (batch,)) to "
        "`self.tracked_gradient(tape, loss, variables, per_example_loss=...)`. A penalty "
        "of the weights alone stays supported as `kernel_regularizer=`."
    )


def added_loss_error(layer: Any) -> str:
    what = f"{'Model' if hasattr(layer, 'compile') else 'Layer'} {layer.name!r} ({type(layer).__name__})"
    common = (
        f"{what} adds a loss in `call` (`self.add_loss`). Keras adds it to the batch loss "
        "as one number, which belongs to no example, so per-example gradients cannot "
        "include it. "
    )
    if computes_ctc(layer):
        return common + (
            "It looks like a CTC loss computed in a layer (the keras-io OCR example's "
            "CTCLayer): make it the model's loss instead, `compile(loss=keras.losses.CTC())` "
            "with the labels as `y`, and drop the layer (the model's output is then "
            "`y_pred`). Keras' CTC loss gives one value per example."
        )
    return common + (
        "The way out depends on the term: a loss of the model's outputs and targets (a "
        "CTC loss in a layer): make it the compiled loss (`compile(loss=...)`, one value "
        "per example, e.g. keras.losses.CTC); a term per example (a VAE's KL divergence): "
        "return it from `call` per example and, in a train_step of your own, pass "
        "`per_example_loss=reconstruction + kl` (shape (batch,)) to "
        "`self.tracked_gradient(tape, loss, variables, per_example_loss=...)` (see "
        "GradientTrackingMixin.tracked_gradient); a penalty of the weights alone: "
        "`kernel_regularizer=`, which is supported."
    )


def computes_ctc(layer: Any) -> bool:
    """Whether the layer's class or name speaks of a CTC loss."""
    names = [layer.name, *(cls.__name__ for cls in type(layer).__mro__)]
    if any("ctc" in name.lower() for name in names):
        return True
    try:
        source = inspect.getsource(type(layer))
    except (OSError, TypeError):
        return False
    return "ctc" in source.lower()
