"""Layer calls whose inputs do not depend on the batch, broadcast to it.

A learned position table (`pos_emb(ops.arange(maxlen))`), a Dense applied to a
constant or a token looked up by a constant id give the same value to every
example: the call has no batch axis, and the gradient at its output is the sum
over the batch. Its per-example gradient lives where its output meets the batch,
through a broadcast (`x + positions`). On a tracked step such a call is made on
its inputs broadcast to the batch size, so its outputs carry one row per example
(the same values in every row) and the layer's rule or the fallback applies
unchanged. Values outside the call do not change, provided the outputs reach the
batch through operations that treat the batch axis row by row; otherwise the
step raises (`refuse_batchless_outputs_mixing_rows`).

Whether a call is batchless is read from the traced graph (the batch size alone
cannot tell a sequence of length B from a batch of B): its tensor arguments are
batchless when no path leads from them back to the step's data, except through
the shape of a non-batch axis (`ops.arange(ops.shape(x)[1])`). In an eager step
there is no graph; there a call is batchless when no tensor argument has the
batch's leading size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from keras import tree

# Operations applied element by element (with broadcasting): on tensors whose
# first axis is the batch, each example's rows stay its own.
ELEMENTWISE_OPS = frozenset(
    {
        *("Identity", "Cast", "StopGradient", "Neg", "Abs", "Square", "Sqrt", "Rsqrt"),
        *("Exp", "Log", "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus"),
        *("Softsign", "Erf", "Sin", "Cos", "Reciprocal", "Sign", "Floor", "Round"),
        *("AddV2", "Add", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum"),
        *("SquaredDifference", "Pow", "BiasAdd", "Select", "SelectV2", "BroadcastTo"),
    }
)
# Operations that combine tensors along one axis (not the batch axis, checked).
CONCAT_OPS = frozenset({"ConcatV2"})
# Operations whose values do not depend on their inputs' values, only their shapes.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


class BatchDependence:
    """Answers, at trace time, which tensors depend on a step's batch.

    Args:
        batch: The step's data (`x`, `y`, `sample_weight`, any structure); its
            first tensor with an axis gives the batch size.
    """

    def __init__(self, batch: Any) -> None:
        tensors = [t for t in tree.flatten(batch) if isinstance(t, tf.Tensor)]
        self.eager = tf.executing_eagerly() or any(not hasattr(t, "graph") for t in tensors)
        self._sources = set() if self.eager else {t.ref() for t in tensors}
        leading = [t for t in tensors if t.shape.rank]
        self._first = leading[0] if leading else None
        # Per operation, whether it depends on the batch: through its size, or not.
        self._memo: dict[bool, dict[Any, bool]] = {True: {}, False: {}}
        # The batch's static size that `with_unknown_batch_size` erased, if any.
        self.static_batch_size = None
        first = self._first
        if not self.eager and first is not None and first.op.type == "PlaceholderWithDefault":
            self.static_batch_size = first.op.inputs[0].shape[0]

    def batch_size(self) -> tf.Tensor:
        """The number of examples in the batch (int32 scalar)."""
        assert self._first is not None
        return tf.shape(self._first)[0]

    def is_batchless(self, args: Any) -> bool:
        """Whether `args` (any structure) hold dense tensors and none depends on the batch."""
        values = [t for t in tree.flatten(args) if tf.is_tensor(t)]
        tensors = [t for t in values if isinstance(t, tf.Tensor)]
        # A sparse or ragged argument is not walked: the call is taken as it comes.
        if self._first is None or not tensors or len(tensors) < len(values):
            return False
        if self.eager:
            size = self._first.shape[0]
            return all(not t.shape.rank or t.shape[0] != size for t in tensors)
        return not any(self.depends(t, through_shapes=True) for t in tensors)

    def with_static_batch_size(self, args: Any) -> Any:
        """`args` with the batch's static size restored on the tensors that depend on it.

        For the rules only (the layer's call sees the tensors as they are): they
        choose their cheaper form from static sizes, the batch size among them.
        """
        size = self.static_batch_size
        if size is None:
            return args

        def restored(value: Any) -> Any:
            if (
                isinstance(value, tf.Tensor)
                and value.shape.rank
                and value.shape[0] is None
                and self.depends(value, through_shapes=True)
            ):
                return tf.ensure_shape(value, [size, *value.shape[1:]])
            return value

        return tree.map_structure(restored, args)

    def depends(self, tensor: tf.Tensor, through_shapes: bool) -> bool:
        """Whether a path leads from the batch's data to `tensor`.

        Args:
            tensor: A tensor of the graph being traced.
            through_shapes: Whether a path through the batch size counts (the size
                of a non-batch axis never does).
        """
        if not hasattr(tensor, "graph"):
            # A value made outside the step (a position index built in `build`,
            # an eager constant): captured by the step's graph, batch-free.
            return False
        memo = self._memo[through_shapes]
        # Post-order over the operations `tensor` comes from, each visited once per step.
        stack = [(tensor.op, False)]
        while stack:
            op, inputs_known = stack.pop()
            if op in memo:
                continue
            if any(t.ref() in self._sources for t in op.outputs):
                memo[op] = True
            elif op.type == "Placeholder" and not is_capture(op):
                memo[op] = True  # an argument of the traced function that is not the batch
            elif inputs_known:
                memo[op] = any(memo[t.op] for t in value_inputs(op, through_shapes))
            else:
                stack.append((op, True))
                stack.extend((t.op, False) for t in value_inputs(op, through_shapes))
        return memo[tensor.op]


def value_inputs(op: Any, through_shapes: bool) -> list[tf.Tensor]:
    """The inputs of `op` its values can depend on (see `BatchDependence.depends`)."""
    if op.type in SHAPE_OPS and not through_shapes:
        return []
    if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape":
        axis = sliced_axis(op)
        if axis is not None and axis != 0:
            return []
    if op.type == "Placeholder":
        return captured_outer(op)
    return list(op.inputs)


def is_capture(placeholder: Any) -> bool:
    """Whether a function graph's placeholder stands for a captured value (a variable, a constant)."""
    internal = placeholder.outputs[0]
    return any(inside is internal for _, inside in getattr(placeholder.graph, "captures", ()))


def sliced_axis(op: Any) -> int | None:
    """The one axis whose size `shape(x)[axis]` reads, or None for anything else."""
    begin = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape[0]
    if begin is None or len(begin) != 1 or rank is None or not op.get_attr("shrink_axis_mask"):
        return None
    return int(begin[0]) % rank


def captured_outer(placeholder: Any) -> list[tf.Tensor]:
    """The outer graph's tensor that a function graph's placeholder captures."""
    graph = placeholder.graph
    for external, internal in getattr(graph, "captures", ()):
        if internal is placeholder.outputs[0]:
            return [external] if hasattr(external, "op") and hasattr(external, "graph") else []
    return []


def with_unknown_batch_size(data: Any) -> Any:
    """The step's data with the static size of the batch axis erased.

    A size read from a static shape is a Python number, tied to nothing in the
    graph: `ops.zeros((ops.shape(x)[0], dim))` would look like a constant that
    does not depend on the batch. With the size unknown it is read from the data
    (as in `fit` steps with a ragged last batch), and the walk finds the batch.
    The values pass as they are; the rules get the static size back
    (`BatchDependence.with_static_batch_size`).
    """
    if tf.executing_eagerly():
        return data

    def erased(value: Any) -> Any:
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return tf.raw_ops.PlaceholderWithDefault(input=value, shape=[None, *value.shape[1:]])
        return value

    return tree.map_structure(erased, data)


def broadcast_arguments(args: Any, batch_size: tf.Tensor) -> Any:
    """Every tensor among `args` with a batch axis in front.

    When every tensor has a leading axis of size 1 (a `(1, maxlen)` position
    index, say), that axis becomes the batch axis; otherwise a batch axis is
    prepended, so that a `(maxlen,)` index gives `(B, maxlen, dim)` outputs that
    broadcast against `(B, maxlen, dim)` the way `(maxlen, dim)` did.
    """
    tensors = [t for t in tree.flatten(args) if isinstance(t, tf.Tensor)]
    replace_leading = bool(tensors) and all(t.shape.rank and t.shape[0] == 1 for t in tensors)

    def broadcast(value: Any) -> Any:
        if not isinstance(value, tf.Tensor):
            return value
        if not replace_leading:
            value = value[None]
        shape = tf.concat([[batch_size], tf.shape(value)[1:]], axis=0)
        result = tf.broadcast_to(value, shape)
        result.set_shape([None, *value.shape[1:]])
        return result

    return tree.map_structure(broadcast, args)


def refuse_batchless_outputs_mixing_rows(
    taps: Sequence[Any], forward: range, dependence: BatchDependence | None
) -> None:
    """Raises the first of `rows_mixing_errors`, if any."""
    for _, error in rows_mixing_errors(taps, forward, dependence):
        raise error


def rows_mixing_errors(
    taps: Sequence[Any], forward: range, dependence: BatchDependence | None
) -> list[tuple[Any, ValueError]]:
    """`(layer, error)` for each broadcast batchless call whose outputs do not reach
    the batch row by row.

    Args:
        taps: The step's `taps.LayerTap`s, with their recorded calls.
        forward: Positions of the forward pass' operations in the graph.
        dependence: The step's batch dependence (None: nothing was broadcast).

    From each batchless call's outputs, the forward operations that use them are
    followed until they meet values of the batch. Each must keep the batch axis
    first and treat it row by row: elementwise operations (`x + positions`), a
    broadcast, a concatenation along another axis, or the call of another tracked
    layer (the engine treats every tracked layer's rows as examples). A reduction,
    reshape or tile over the broadcast axis would see B copies where the model
    meant one: an error names the layer and the operation.
    """
    calls = [(tap.layer, call) for tap in taps for call in tap.recorded]
    batchless = [(layer, call) for layer, call in calls if call.batchless]
    if not batchless or dependence is None or dependence.eager or not forward:
        return []
    operations = batchless[0][1].graph.get_operations()
    position = {operations[i].name: i for i in forward}
    errors = []
    for layer, call in batchless:
        # Other tracked calls (not around this one) keep rows: follow their outputs.
        others = [
            other
            for _, other in calls
            if other is not call and call.graph_ops.start not in other.graph_ops
        ]
        op = first_op_mixing_rows(call, others, position, dependence)
        if op is not None:
            errors.append((layer, batchless_error(layer, call, op)))
    return errors


def first_op_mixing_rows(
    call: Any, others: Sequence[Any], position: dict[str, int], dependence: BatchDependence
) -> Any:
    """The first forward operation on the way from `call`'s outputs to the batch that
    may mix the broadcast rows, or None."""
    stack = [t for t in tree.flatten(call.outputs) if isinstance(t, tf.Tensor)]
    seen: set[Any] = set()
    while stack:
        tensor = stack.pop()
        for op in tensor.consumers():
            index = position.get(op.name)
            if index is None or op in seen or op.type in SHAPE_OPS:
                continue
            seen.add(op)
            owner = next((other for other in others if index in other.graph_ops), None)
            if owner is not None:
                if not any(
                    dependence.depends(t, through_shapes=False)
                    for t in tree.flatten(owner.call.args)
                    if tf.is_tensor(t)
                ):
                    stack.extend(t for t in tree.flatten(owner.outputs) if isinstance(t, tf.Tensor))
                continue
            if not keeps_rows(op, tensor.shape.rank):
                return op
            meets_batch = any(
                t is not tensor and dependence.depends(t, through_shapes=False) for t in op.inputs
            )
            if not meets_batch:
                stack.extend(op.outputs)
    return None


def keeps_rows(op: Any, rank: int | None) -> bool:
    """Whether `op`, applied to a tensor of rank `rank` (batch axis first), keeps each
    row its own."""
    out_ranks = {t.shape.rank for t in op.outputs}
    if rank is None or out_ranks != {rank}:
        return False
    if op.type in ELEMENTWISE_OPS:
        return True
    if op.type in CONCAT_OPS:
        axis = tf.get_static_value(op.inputs[-1])
        return axis is not None and int(axis) % rank != 0
    return False


def batchless_error(layer: Any, call: Any, op: Any) -> ValueError:
    return ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) is called on values that do not "
        "depend on the batch (the same for every example), so its per-example gradients "
        "are taken where its outputs meet the batch: the tracked step broadcasts the call "
        "to the batch size. Its outputs must then reach the batch through operations that "
        "keep the batch axis first and treat it row by row (`x + positions`, "
        "`ops.broadcast_to(token, (batch, 1, dim))`, a concatenation along another axis), "
        f"but they reach operation {op.name!r} (type {op.type}) first. Combine the output "
        "with the batch by broadcasting instead. Received: outputs of shape "
        f"{[t.shape for t in tree.flatten(call.outputs) if isinstance(t, tf.Tensor)]} "
        "after the broadcast."
    )
