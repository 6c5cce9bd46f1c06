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

from keras_gradtrack.rules.contract import LayerCall, Rule, Tapped


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """A `LayerCall` and where its operations are in the traced graph.

    Attributes:
        call: The call as the rules see it (no output gradients yet).
        graph_ops: Positions, in the graph's operations, of the ops the call
            created (empty when run eagerly).
        graph: The graph the call was traced in (None when run eagerly).
    """

    call: LayerCall
    graph_ops: range = range(0)
    graph: Any = None


class LayerTap:
    """Records the calls of one layer while installed.

    Args:
        layer: The Keras layer to tap.
        rule: The layer's rule (None for the fallback): it says what to record.
    """

    def __init__(self, layer: Any, rule: Rule | None):
        self.layer = layer
        self.rule = rule
        self.recorded: list[RecordedCall] = []
        self._original_call: Callable[..., Any] | None = None
        self._shadowed_call: Callable[..., Any] | None = None

    @property
    def original_call(self) -> Callable[..., Any]:
        """The layer's own `call`, also while the tap is installed."""
        return self._original_call or self.layer.call

    def install(self) -> None:
        self.recorded = []
        self._shadowed_call = self.layer.__dict__.get("call")
        self._original_call = self.layer.call
        # An instance attribute shadows the class's `call`; Layer.__call__
        # looks `self.call` up on every call.
        self.layer.call = self._recording_call

    def uninstall(self) -> None:
        if self._original_call is None:
            return
        if self._shadowed_call is not None:
            self.layer.__dict__["call"] = self._shadowed_call
        else:
            self.layer.__dict__.pop("call", None)
        self._original_call = None

    def _recording_call(self, *args: Any, **kwargs: Any) -> Any:
        with graph_ops_recorded() as ops:
            outputs, tapped = self._tapped_call(args, kwargs)
        call = LayerCall(args=args, kwargs=kwargs, tapped=tapped.tapped, saved=tapped.saved)
        self.recorded.append(RecordedCall(call, ops.range, ops.graph))
        return outputs

    def _tapped_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Tapped]:
        original = self.original_call
        if self.rule is not None and self.rule.tap is not None:
            tapped = self.rule.tap(self.layer, original, args, kwargs)
            return tapped.outputs, tapped
        if self.rule is None or not self.rule.split_activation:
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
        activation = self.layer.activation
        preactivations: list[tf.Tensor] = []

        def recording_activation(preactivation: tf.Tensor) -> tf.Tensor:
            preactivations.append(preactivation)
            return activation(preactivation)

        self.layer.activation = recording_activation
        try:
            outputs = original(*args, **kwargs)
        finally:
            self.layer.activation = activation
        if len(preactivations) != 1:
            raise RuntimeError(
                f"Layer {self.layer.name!r} ({type(self.layer).__name__}) applied its "
                f"`activation` {len(preactivations)} times in `call` (expected once), so "
                "its pre-activation output cannot be tapped. Register its class with a "
                "rule of `split_activation=False` (keras_gradtrack.register_rule)."
            )
        return outputs, Tapped(outputs, (preactivations[0],))


@contextlib.contextmanager
def installed(taps: Sequence[LayerTap]) -> Iterator[Sequence[LayerTap]]:
    """Installs every tap for the duration of the block, then restores the layers."""
    try:
        for tap in taps:
            tap.install()
        yield taps
    finally:
        for tap in taps:
            tap.uninstall()


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
