"""Exact per-example gradients where BatchNormalization in training mode couples examples.

In training mode BatchNormalization normalizes with the batch's mean and variance,
so example i's loss depends on the outputs of every example at the layers before
it. With the other examples held fixed, `g_i = d l_i / d theta` then includes the
terms through the batch statistics, and `sum_i g_i = G` exactly. Which layers
this touches:

* a layer whose variables feed a BatchNormalization in training mode (its outputs
  reach one) is *coupled*: its gradient for example i collects every example's
  share. Its primitives come from the rows of the Jacobian of the loss vector,
  one vector-Jacobian product per example on a persistent tape recorded with the
  forward pass, vectorized (`tf.vectorized_map`) in chunks of examples and reduced
  to `sq_norm` and `dot` inside each chunk: memory chunk x (coupled parameters),
  time about one backward pass per example through the coupled part.
* every other layer (after the last such BatchNormalization, or beside it) keeps
  its rule: its output gradient is example i's alone. That includes a
  BatchNormalization's own gamma and beta when no other one follows
  (`rules.batch_normalization`).

A rank-two structure (per channel, BatchNormalization's cross-example Jacobian
is `-(gamma / sigma N)(1 + xhat_i xhat_j)`) would correct the one layer right
before a BatchNormalization cheaply, but each further BatchNormalization adds two
directions per channel to every layer before it, which exceeds the batch size
after a block or two in the networks that use it: the per-example rows are the
cheaper exact method there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack._keras_seam import flatten_layers
from keras_gradtrack._patching import patched_each
from keras_gradtrack.engine.batch_normalization_tracking import DEFAULT_CHUNK_SIZE
from keras_gradtrack.engine.checks import captured_handle
from keras_gradtrack.engine.plan import EXAMPLE_MIXING_LAYERS, TrackedLayer
from keras_gradtrack.rules.batch_normalization import uses_batch_statistics
from keras_gradtrack.rules.contract import LayerPrimitives, Reference


@dataclasses.dataclass(frozen=True)
class MixingCall:
    """One call of an example-mixing layer in training mode.

    Attributes:
        layer: The layer (a BatchNormalization).
        inputs: The input tensor it normalized with the batch's statistics.
    """

    layer: Any
    inputs: tf.Tensor


def coupling_recorder(model: Any) -> CouplingRecorder | None:
    """A recorder for the model's tracked steps, if it opted in and has mixing layers."""
    if not getattr(model, "track_batch_normalization", False):
        return None
    recorder = CouplingRecorder(model)
    return recorder if recorder.layers else None


def chunk_size_of(model: Any) -> int:
    """Examples per vectorized chunk of the coupled rows."""
    return int(getattr(model, "batch_normalization_chunk_size", DEFAULT_CHUNK_SIZE))


def mixing_layers(model: Any) -> list[Any]:
    """The model's layers that mix examples when called in training mode."""
    return [
        layer
        for layer in flatten_layers(model, include_self=False)
        if isinstance(layer, EXAMPLE_MIXING_LAYERS) and layer.trainable
    ]


class CouplingRecorder:
    """Records the mixing calls of a tracked step, and the step's forward pass on a tape.

    Entered with the forward pass (`engine.tracking.TrackingContext`) and left
    before the backward pass; afterwards `tape` differentiates the forward pass
    as often as needed (it is persistent).

    Args:
        model: The model whose step is traced.
    """

    def __init__(self, model: Any) -> None:
        self.layers = mixing_layers(model)
        self.calls: list[MixingCall] = []
        self.tape: tf.GradientTape | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[CouplingRecorder]:
        self.calls = []
        # An instance attribute shadows the class's `call` (as the taps do).
        calls = [(layer, "call", self._recording_call(layer, layer.call)) for layer in self.layers]
        with patched_each(calls), tf.GradientTape(persistent=True) as tape:
            self.tape = tape
            yield self

    def _recording_call(self, layer: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        def recording(*args: Any, **kwargs: Any) -> Any:
            if uses_batch_statistics(layer, args, kwargs):
                refuse_synchronized_across_replicas(layer)
                inputs = args[0] if args else kwargs["inputs"]
                self.calls.append(MixingCall(layer, inputs))
            return call(*args, **kwargs)

        return recording


def refuse_synchronized_across_replicas(layer: Any) -> None:
    """Raises for a synchronized BatchNormalization whose statistics span several replicas."""
    if getattr(layer, "synchronized", False) and tf.distribute.has_strategy():
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            raise ValueError(
                f"Layer {layer.name!r} is a BatchNormalization with synchronized=True: its "
                "batch statistics span the examples of every replica, and per-example "
                "gradients through them are computed per replica only. Expected "
                f"synchronized=False under a strategy. Received: {replicas} replicas"
            )


def refuse_coupled_input_gradients(
    recorder: CouplingRecorder | None, statistics: Sequence[Any]
) -> None:
    """Raises when a statistic needs `d l_i / d x_i` and a mixing call couples the inputs.

    The backward pass gives `sum_j d l_j / d x_i` at example i's input, which is
    example i's own gradient only when no example reaches another's loss.
    """
    needing = [s.name for s in statistics if s.needs_input_gradients]
    if needing and recorder is not None and recorder.calls:
        raise ValueError(
            f"Layer {recorder.calls[0].layer.name!r} is a BatchNormalization in training "
            "mode, so every example's loss depends on every input of the batch, and the "
            "backward pass does not give d l_i / d x_i. Expected statistics without "
            f"input gradients. Received: {needing}"
        )


def coupled_layer_names(
    recorder: CouplingRecorder | None, plan: Sequence[TrackedLayer]
) -> set[str]:
    """The tracked layers whose per-example gradients the mixing calls couple.

    A layer is coupled when one of its variables reaches the input of a
    mixing call, or when it is itself a mixing layer in training mode without
    a rule (its exact form is then the Jacobian's: the per-layer fallback would
    run its call, and update its statistics, again).
    """
    if recorder is None or not recorder.calls:
        return set()
    variables = [v for tracked in plan for v in tracked.variables]
    reaching = variables_reaching([call.inputs for call in recorder.calls], variables, recorder)
    mixing = {id(call.layer) for call in recorder.calls}
    return {
        tracked.name
        for tracked in plan
        if any(id(v) in reaching for v in tracked.variables)
        or (id(tracked.layer) in mixing and tracked.rule is None)
    }


def variables_reaching(
    tensors: Sequence[tf.Tensor], variables: Sequence[Any], recorder: CouplingRecorder
) -> set[int]:
    """Ids of the variables that some of `tensors` depend on.

    In a traced step, a walk up the graph from the tensors to the variables'
    handles; run eagerly, the tape's gradients that are not None.
    """
    if tf.executing_eagerly():
        assert recorder.tape is not None
        gradients = recorder.tape.gradient(
            list(tensors),
            [v.value for v in variables],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
        return {id(v) for v, gradient in zip(variables, gradients) if gradient is not None}
    graph = tensors[0].graph
    handles = {}
    for variable in variables:
        handle = captured_handle(graph, variable)
        if handle is not None:
            handles[handle.name] = id(variable)
    reaching: set[int] = set()
    seen: set[str] = set()
    pending = [tensor.op for tensor in tensors]
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for tensor in op.inputs:
            if tensor.name in handles:
                reaching.add(handles[tensor.name])
            pending.append(tensor.op)
    return reaching


class CoupledGradients:
    """The per-example gradients of the coupled layers, as rows of the loss vector's Jacobian.

    Row i is the gradient of `sum_t v_it w_it` over the step's weighted loss values
    `v` restricted to example i, with `w = dL/dv` from the backward pass: `c s d l_i /
    d theta`, the scale the rules work in (see `rules.contract.RuleFn`).

    Args:
        tape: The persistent tape of the forward pass.
        layers: The coupled layers.
        loss_cotangents: `(v, dL/dv)` for every loss value tensor the loss depends on.
        chunk_size: Examples per vectorized chunk.
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        layers: Sequence[TrackedLayer],
        loss_cotangents: Sequence[tuple[tf.Tensor, tf.Tensor]],
        chunk_size: int,
    ) -> None:
        self.tape = tape
        self.layers = tuple(layers)
        self.targets = [target for target, _ in loss_cotangents]
        self.cotangents = [
            tf.cast(cotangent, target.dtype) for target, cotangent in loss_cotangents
        ]
        self.chunk_size = chunk_size
        self.batch_size = tf.shape(self.targets[0])[0]

    def example_gradients(self, index: tf.Tensor) -> list[list[tf.Tensor]]:
        """Per coupled layer, example `index`'s gradients of its variables (float32)."""
        variables = [v for tracked in self.layers for v in tracked.variables]
        rows = [
            tf.cast(tf.equal(tf.range(self.batch_size), index), cotangent.dtype)
            for cotangent in self.cotangents
        ]
        masked = [
            cotangent * tf.reshape(row, [-1] + [1] * (cotangent.shape.rank - 1))
            for cotangent, row in zip(self.cotangents, rows)
        ]
        gradients = iter(
            self.tape.gradient(
                self.targets,
                [v.value for v in variables],
                output_gradients=masked,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        )
        return [
            [tf.cast(tf.convert_to_tensor(next(gradients)), tf.float32) for _ in tracked.variables]
            for tracked in self.layers
        ]

    def primitives(self, reference: Reference | None) -> dict[str, LayerPrimitives]:
        """`{layer name: (sq_norm, dot)}` of every coupled layer, in chunks of examples
        (no dot without a `reference`)."""
        references = (
            None
            if reference is None
            else [[reference(v) for v in tracked.variables] for tracked in self.layers]
        )
        width = 1 if references is None else 2

        def example_primitives(index: tf.Tensor) -> tf.Tensor:
            # Plain reductions: the vectorizer has no rule for EuclideanNorm.
            columns = []
            for k, gradients in enumerate(self.example_gradients(index)):
                columns.append(tf.add_n([tf.reduce_sum(tf.square(g)) for g in gradients]))
                if references is not None:
                    pairs = zip(gradients, references[k])
                    columns.append(tf.add_n([tf.reduce_sum(g * r) for g, r in pairs]))
            return tf.stack(columns)

        values = self.chunked(example_primitives, width * len(self.layers))
        return {
            tracked.name: LayerPrimitives(
                sq_norm=values[:, width * k],
                dot=None if references is None else values[:, width * k + 1],
            )
            for k, tracked in enumerate(self.layers)
        }

    def grams(self) -> dict[str, tf.Tensor]:
        """`{layer name: (B, B) Gram matrix}` of every coupled layer (all rows at once)."""
        sizes = [sum(math.prod(v.shape) for v in tracked.variables) for tracked in self.layers]

        def example_row(index: tf.Tensor) -> tf.Tensor:
            return tf.concat(
                [tf.reshape(g, [-1]) for grads in self.example_gradients(index) for g in grads],
                axis=0,
            )

        rows = self.chunked(example_row, sum(sizes))
        grams, start = {}, 0
        for tracked, size in zip(self.layers, sizes):
            block = rows[:, start : start + size]
            grams[tracked.name] = tf.matmul(block, block, transpose_b=True)
            start += size
        return grams

    def chunked(self, per_example: Callable[[tf.Tensor], tf.Tensor], width: int) -> tf.Tensor:
        """`(B, width)`: `per_example(i)` for every example, vectorized over chunks.

        The last chunk repeats the last example up to the chunk size (its rows are
        dropped), so that every chunk has one static shape.
        """
        batch, chunk = self.batch_size, self.chunk_size
        if chunk == 1:
            return tf.map_fn(
                per_example, tf.range(batch), fn_output_signature=tf.TensorSpec([width], tf.float32)
            )

        def chunk_values(start: tf.Tensor) -> tf.Tensor:
            indices = tf.minimum(start + tf.range(chunk), batch - 1)
            return tf.vectorized_map(per_example, indices)

        starts = tf.range(0, batch, chunk)
        values = tf.map_fn(
            chunk_values,
            starts,
            fn_output_signature=tf.TensorSpec([chunk, width], tf.float32),
        )
        return tf.reshape(values, [-1, width])[:batch]
