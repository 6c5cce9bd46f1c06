"""Trace-time taps: record what each tracked layer sees during the forward pass.

The tracked train step is traced once, so a tap is installed on the layer
instance for the duration of that forward pass only and costs nothing at run
time. A tap records, per call of its layer, a `LayerCall`: the arguments the
layer's `call` received, and the tensors whose gradient the rule needs (the
pre-activation output for layers whose `activation` can be split off, what the
rule's own tap returns, or the layer's float outputs), plus where in the graph
the call's operations are (for the tied-weight check).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf
from keras import tree

from keras_gradtrack._keras_seam import KERAS_MASK, get_tensor_attr, set_tensor_attr
from keras_gradtrack._patching import patched
from keras_gradtrack.engine.batchless import BatchDependence, broadcast_arguments
from keras_gradtrack.engine.preactivation import marked_preactivation_call
from keras_gradtrack.rules.contract import LayerCall, Rule, Tapped


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """A `LayerCall` and where its operations are in the traced graph.

    Attributes:
        call: The call as the rules see it (no output gradients yet).
        graph_ops: Positions, in the graph's operations, of the ops the call
            created (empty when run eagerly).
        graph: The graph the call was traced in (None when run eagerly).
        outputs: What the call returned.
        batchless: Whether the call's inputs did not depend on the batch (they
            were broadcast to it).
    """

    call: LayerCall
    graph_ops: range = range(0)
    graph: Any = None
    outputs: Any = None
    batchless: bool = False


class LayerTap:
    """Records the calls of one layer while installed.

    Args:
        layer: The Keras layer to tap.
        rule: The layer's rule (None for the fallback): it says what to record.
        batch: Which tensors depend on the step's batch (None: calls are taken
            as they come).
        xla: The step is compiled by XLA (`LayerCall.xla` of every call recorded).
    """

    def __init__(
        self,
        layer: Any,
        rule: Rule | None,
        batch: BatchDependence | None = None,
        xla: bool = False,
    ):
        self.layer = layer
        self.xla = xla
        self.rule = rule
        self.batch = batch
        self.recorded: list[RecordedCall] = []
        self._original_call: Callable[..., Any] | None = None

    @property
    def original_call(self) -> Callable[..., Any]:
        """The layer's own `call`, also while the tap is installed."""
        return self._original_call or self.layer.call

    @contextlib.contextmanager
    def installed(self) -> Iterator[LayerTap]:
        """The tap on its layer for the block: the layer's `call` records."""
        self.recorded = []
        # An instance attribute shadows the class's `call`; Layer.__call__
        # looks `self.call` up on every call.
        with patched(self.layer, "call", self._recording_call) as original:
            self._original_call = original
            try:
                yield self
            finally:
                self._original_call = None

    def _recording_call(self, *args: Any, **kwargs: Any) -> Any:
        with graph_ops_recorded() as ops:
            batchless = self.batch is not None and self.batch.is_batchless((args, kwargs))
            if batchless:
                assert self.batch is not None
                args, kwargs = broadcast_arguments((args, kwargs), self.batch.batch_size())
            outputs, tapped = self._tapped_call(args, kwargs)
            if self.batch is not None and not batchless:
                args, kwargs = self.batch.with_static_batch_size((args, kwargs))
        call = LayerCall(
            args=args, kwargs=kwargs, tapped=tapped.tapped, saved=tapped.saved, xla=self.xla
        )
        self.recorded.append(RecordedCall(call, ops.range, ops.graph, outputs, batchless))
        return outputs

    def _tapped_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Tapped]:
        own_outputs: list[Any] = []

        def original(*call_args: Any, **call_kwargs: Any) -> Any:
            outputs = self.original_call(*call_args, **call_kwargs)
            own_outputs.append(outputs)
            return outputs

        outputs, tapped = self._paths_call(original, args, kwargs)
        if own_outputs:
            # What the layer attached to its outputs in `call` (a padding mask)
            # goes with the tensors the path returns in their place.
            carry_metadata(own_outputs[-1], outputs)
        return outputs, tapped

    def _paths_call(
        self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Tapped]:
        if self.rule is not None and self.rule.tap is not None:
            tapped = self.rule.tap(self.layer, original, args, kwargs)
            return tapped.outputs, tapped
        if self.rule is None or not self.rule.splits_activation(self.layer):
            # Fresh copies, one per output position: the gradient at a copy is what
            # reaches it from outside the call. At the call's own tensors it would also
            # include paths inside the call (an LSTM cell returns `h, [h, c]` with `h`
            # computed from `c`), counted twice.
            outputs = tree.map_structure(fresh_float_copy, original(*args, **kwargs))
            floats = tuple(
                t for t in tree.flatten(outputs) if isinstance(t, tf.Tensor) and t.dtype.is_floating
            )
            return outputs, Tapped(outputs, floats)
        return self._preactivation_call(original, args, kwargs)

    def _preactivation_call(
        self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Tapped]:
        outputs, preactivation = marked_preactivation_call(
            self.layer,
            original,
            args,
            kwargs,
            lambda z: z,
            "tapped. Register its class with a rule of `split_activation=False` "
            "(keras_gradtrack.register_rule).",
        )
        return outputs, Tapped(outputs, (preactivation,))


@contextlib.contextmanager
def installed(taps: Sequence[LayerTap]) -> Iterator[Sequence[LayerTap]]:
    """Installs every tap for the duration of the block, then restores the layers.

    An error raised in the block after a call was broadcast to the batch (a shape
    mismatch further on, say) gets a note naming the broadcast layers.
    """
    try:
        with contextlib.ExitStack() as stack:
            for tap in taps:
                stack.enter_context(tap.installed())
            yield taps
    except Exception as error:
        broadcast = [tap.layer.name for tap in taps if any(c.batchless for c in tap.recorded)]
        if broadcast:
            error.add_note(
                f"The tracked step broadcast the calls of layers {broadcast} to the batch size: "
                "their inputs do not depend on the batch. If the error comes from there, "
                "combine their outputs with the batch by broadcasting (`x + positions`, "
                "`ops.broadcast_to(token, (batch, 1, dim))`) rather than tiling or reshaping."
            )
        raise


# Attributes Keras attaches to tensors.
KERAS_TENSOR_ATTRIBUTES = (KERAS_MASK,)


def carry_metadata(source: Any, target: Any) -> None:
    """Attaches the Keras attributes of `source`'s tensors (a mask set in `call`) to
    the tensors at the same positions of `target` that stand in for them."""
    own_leaves, returned_leaves = tree.flatten(source), tree.flatten(target)
    if len(own_leaves) != len(returned_leaves):
        return  # the path returned another structure: nothing stands in for the call's own
    for own, returned in zip(own_leaves, returned_leaves):
        if own is returned or not tf.is_tensor(own) or not tf.is_tensor(returned):
            continue
        for name in KERAS_TENSOR_ATTRIBUTES:
            value = get_tensor_attr(own, name)
            if value is not None and get_tensor_attr(returned, name) is None:
                set_tensor_attr(returned, name, value)


def fresh_float_copy(value: Any) -> Any:
    if isinstance(value, tf.Tensor) and value.dtype.is_floating:
        return tf.identity(value)
    return value


class OpRange:
    """Positions of the graph operations created inside a `graph_ops_recorded` block."""

    def __init__(self) -> None:
        self.range = range(0)
        self.graph: Any = None


@contextlib.contextmanager
def graph_ops_recorded() -> Iterator[OpRange]:
    """Records which operations of the graph being traced the block creates."""
    recorded = OpRange()
    if tf.executing_eagerly():
        yield recorded
        return
    graph = tf.compat.v1.get_default_graph()
    recorded.graph = graph
    start = len(graph.get_operations())
    try:
        yield recorded
    finally:
        recorded.range = range(start, len(graph.get_operations()))
