"""Trace-time taps: record what each tracked layer sees during the forward pass.

The tracked train step is traced once, so a tap is installed on the layer
instance for the duration of that forward pass only and costs nothing at run
time. A tap records, per call of its layer:

* the positional and keyword arguments the layer's `call` received (the layer
  input, for the rules; everything, for the fallback that re-runs the layer);
* the tensor whose gradient the engine needs: the pre-activation output for
  layers whose `activation` can be split off (Dense, EinsumDense, Conv, ...),
  the layer's outputs otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from keras import tree


@dataclasses.dataclass
class LayerCall:
    """One call of a tapped layer, as seen at trace time.

    Attributes:
        args: Positional arguments that the layer's `call` received.
        kwargs: Keyword arguments that the layer's `call` received.
        tapped: The tensors whose gradient the engine takes: the pre-activation
            output (one tensor) when the activation is split off, else the
            flattened float outputs of the call.
        output_grads: Per-example gradients of the loss at `tapped` (times one
            positive scalar the engine divides out of the results), filled in
            after the backward pass (same structure as `tapped`).
        graph_ops: Positions, in the traced graph's operations, of the ops the
            call created (empty when run eagerly).
        graph: The graph the call was traced in (None when run eagerly).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tapped: list[tf.Tensor] = dataclasses.field(default_factory=list)
    output_grads: list[tf.Tensor] = dataclasses.field(default_factory=list)
    graph_ops: range = range(0)
    graph: Any = None

    @property
    def inputs(self) -> tf.Tensor:
        """The layer's main input (first positional argument or `inputs=`)."""
        if self.args:
            return self.args[0]
        return self.kwargs["inputs"]


class LayerTap:
    """Records the calls of one layer while installed.

    Args:
        layer: The Keras layer to tap.
        split_activation: Whether to record the pre-activation output by
            wrapping `layer.activation` during the call (the layer must apply
            `self.activation` to its linear output, as Dense and Conv do).
    """

    def __init__(self, layer: Any, split_activation: bool):
        self.layer = layer
        self.split_activation = split_activation
        self.calls: list[LayerCall] = []
        self._original_call: Callable[..., Any] | None = None
        self._shadowed_call: Callable[..., Any] | None = None

    def install(self) -> None:
        self.calls = []
        self._shadowed_call = self.layer.__dict__.get("call")
        self._original_call = self.layer.call
        # An instance attribute shadows the class's `call`; Layer.__call__
        # looks `self.call` up on every call.
        self.layer.call = self._recording_call

    def uninstall(self) -> None:
        if self._shadowed_call is not None:
            self.layer.__dict__["call"] = self._shadowed_call
        else:
            self.layer.__dict__.pop("call", None)
        self._original_call = None

    def _recording_call(self, *args: Any, **kwargs: Any) -> Any:
        with graph_ops_recorded() as ops:
            outputs = self._record(*args, **kwargs)
        self.calls[-1].graph_ops = ops.range
        self.calls[-1].graph = ops.graph
        return outputs

    def _record(self, *args: Any, **kwargs: Any) -> Any:
        assert self._original_call is not None
        record = LayerCall(args=args, kwargs=kwargs)
        if not self.split_activation:
            # Fresh copies, one per output position: the gradient at a copy is what
            # reaches it from outside the call. At the call's own tensors it would also
            # include paths inside the call (an LSTM cell returns `h, [h, c]` with `h`
            # computed from `c`), counted twice.
            outputs = tree.map_structure(fresh_float_copy, self._original_call(*args, **kwargs))
            record.tapped = [
                t for t in tree.flatten(outputs) if isinstance(t, tf.Tensor) and t.dtype.is_floating
            ]
            self.calls.append(record)
            return outputs

        activation = self.layer.activation

        def recording_activation(preactivation: tf.Tensor) -> tf.Tensor:
            record.tapped = [preactivation]
            return activation(preactivation)

        self.layer.activation = recording_activation
        try:
            outputs = self._original_call(*args, **kwargs)
        finally:
            self.layer.activation = activation
        if not record.tapped:
            raise RuntimeError(
                f"Layer {self.layer.name!r} ({type(self.layer).__name__}) did not apply "
                "its `activation` in `call`, so its pre-activation output cannot be "
                "tapped. Register the layer class with `split_activation=False`."
            )
        self.calls.append(record)
        return outputs


@contextlib.contextmanager
def installed(taps: list[LayerTap]) -> Iterator[list[LayerTap]]:
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
