"""Rule for Keras' recurrent layers: SimpleRNN, LSTM, GRU, and `keras.layers.RNN` over
their cells, inside a `Bidirectional` or stacked alike.

A recurrent layer's weights belong to its cell, but the loop that uses them is
the layer's, so the rule covers the cell's variables from the layer's calls
(`covers_sublayers`) and the column is the layer's. On a tracked step the
layer's own `call` runs (initial and stateful states, masking, `go_backwards`,
`return_sequences`, `return_state`, `unroll`: all Keras'), with its loop
replaced by the same `backend.rnn` loop over a step split around the input
projection (`keras_gradtrack/recurrent_cells.py`, shared with the JAX engine): `P = X W` is taken before the loop, so the one
backward pass gives `δ_t = dL/dP_t`, the gradient at the gate pre-activations,
and the loop emits `h_{t-1}`. Each weight's per-example gradient is then a sum
over time, `Σ_t a_tᵀ δ_t`, whose squared norm is the sequence-Dense form
`Σ_{t,s} (a_t·a_s)(δ_t·δ_s)` or the materialized product, whichever costs less.
Masked steps contribute nothing: the loop discards their step, so `δ_t = 0` there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from keras_gradtrack._keras_seam import keras_backend
from keras_gradtrack._patching import patched
from keras_gradtrack.recurrent_cells import (
    CellLoop,
    Term,
    loop_of,
    on_a_loop,
    per_example_gradients,
)
from keras_gradtrack.rule_math import gram_is_cheaper
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule, Tapped
from keras_gradtrack.rules.ops import (
    positions_per_example,
    sequence_kernel_sq_norm,
    stacked_along_time,
    sum_of_squares,
)


def recurrent_applies(layer: Any) -> bool:
    """The rule covers a layer whose cell is a built-in SimpleRNN, LSTM or GRU cell
    (or a subclass keeping its `call`) with every weight trained."""
    return on_a_loop(getattr(layer, "cell", None))


def runs_on_cudnn(layer: Any) -> bool:
    """Whether Keras would run this layer's loop on cuDNN (LSTM or GRU on a GPU).

    There a masked step of the output sequence is zero, whatever `zero_output_for_mask`
    says (the generic loop repeats the last output unless it is set), and the last
    output is the last state, as in the generic loop without it.
    """
    cell = layer.cell
    if getattr(layer, "use_cudnn", False) not in (True, "auto") or cell.recurrent_dropout:
        return False
    if isinstance(layer, keras.layers.LSTM):
        args = (cell.activation, cell.recurrent_activation, layer.unroll, cell.use_bias)
        return bool(keras_backend.cudnn_ok(*args))
    if isinstance(layer, keras.layers.GRU):
        args = (cell.activation, cell.recurrent_activation, layer.unroll, cell.use_bias)
        return bool(keras_backend.cudnn_ok(*args, reset_after=cell.reset_after))
    return False


# The integer type of each float width, for `as_bits`.
BITS = {2: tf.int16, 4: tf.int32, 8: tf.int64}


def as_bits(tensor: Any) -> tf.Tensor:
    """The tensor's bits as integers of its width: not differentiable, not copied."""
    tensor = tf.convert_to_tensor(tensor)  # a stateful layer's states are variables
    return tf.bitcast(tensor, BITS[tensor.dtype.size])


def from_bits(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The inverse of `as_bits`."""
    return tf.bitcast(tensor, dtype)


class SplitLoop:
    """The layer's `inner_loop` for one tracked call: Keras' loop over the split step.

    Args:
        layer: The recurrent layer.
    """

    def __init__(self, layer: Any):
        self.layer = layer
        self.projected: tf.Tensor | None = None
        self.saved: dict[str, Any] = {}

    def inner_loop(
        self, sequences: Any, initial_state: Any, mask: Any, training: Any = False
    ) -> tuple[Any, Any, Any]:
        """`(last_output, outputs, states)`, as `RNN.inner_loop` returns them."""
        layer, cell = self.layer, self.layer.cell
        if tree.is_nested(mask):
            mask = mask[0]
        if not tree.is_nested(initial_state):
            initial_state = [initial_state]
        loop: CellLoop = loop_of(cell).for_call(cell, training, sequences, initial_state)  # type: ignore[union-attr]
        projected = loop.project(sequences)
        dtypes: list[tf.DType] = []  # of the emitted tensors, as the step made them
        # Without a mask the last output is the last state (each step returns its `h` as
        # both), so a layer returning only its last output takes it from the states and
        # its output sequence leaves the loop as bits too: the backward pass then has no
        # gradient of the whole sequence, zero but at its last step, to build.
        last_from_state = mask is None and not layer.return_sequences and not layer.unroll

        def step(projected_t: tf.Tensor, states: Any) -> tuple[Any, list[tf.Tensor]]:
            output, new_states, emitted = loop.step(projected_t, states)
            if layer.unroll:  # the unrolled loop stacks outputs, not structures
                return tf.concat([output, *emitted], axis=-1), new_states
            # The while loop keeps one sequence per output: no per-step copy into a
            # concatenation, no split of it afterwards. The emitted ones travel as
            # their bits: a float sequence without a gradient would get a zero one
            # from TensorFlow's while loop (`while_v2._preprocess_grad`), kept from
            # the loop to its backward pass; the rule reads them after the backward.
            dtypes[:] = [tf.as_dtype(tensor.dtype) for tensor in [output, *emitted]]
            if last_from_state:
                output = as_bits(output)
            return (output, *[as_bits(tensor) for tensor in emitted]), new_states

        cudnn = runs_on_cudnn(layer)
        last_output, outputs, states = keras_backend.rnn(
            step,
            projected,
            initial_state,
            go_backwards=layer.go_backwards,
            mask=mask,
            unroll=layer.unroll,
            input_length=sequences.shape[1],
            zero_output_for_mask=layer.return_sequences if cudnn else layer.zero_output_for_mask,
            return_all_outputs=True,  # the emitted sequences are needed whole
        )
        if layer.unroll:
            last_output = last_output[:, : cell.units]
            outputs, *emitted = tf.split(outputs, 1 + len(loop.emitted), axis=-1)
        else:
            last_output, (outputs, *emitted) = last_output[0], outputs
            emitted = [from_bits(sequence, dtype) for sequence, dtype in zip(emitted, dtypes[1:])]
            if last_from_state:
                last_output, outputs = states[0], from_bits(outputs, dtypes[0])
        if layer.go_backwards:
            # The loop emits in its order; pair each step with its input (P's order).
            emitted = [tf.reverse(sequence, axis=[1]) for sequence in emitted]
        self.projected = projected
        self.saved = {"loop": loop, "inputs": sequences, **dict(zip(loop.emitted, emitted))}
        return last_output, outputs, states


def recurrent_tap(layer: Any, call: Any, args: tuple[Any, ...], kwargs: Any) -> Tapped:
    """Runs the layer's own call with its loop split (`SplitLoop`); taps `P`."""
    split = SplitLoop(layer)
    with patched(layer, "inner_loop", split.inner_loop):
        outputs = call(*args, **kwargs)
    if split.projected is None:
        raise RuntimeError(
            f"Layer {layer.name!r} ({type(layer).__name__}) did not run its inner_loop in "
            "call(), so its recurrent rule cannot see its steps."
        )
    return Tapped(outputs, (split.projected,), split.saved)


def call_terms(call: LayerCall) -> list[Term]:
    """The terms of one call, in float32."""
    loop: CellLoop = call.saved["loop"]
    emitted = {name: tf.cast(call.saved[name], tf.float32) for name in loop.emitted}
    inputs = tf.cast(call.saved["inputs"], tf.float32)
    return loop.terms(inputs, emitted, call.output_grad)


def layer_terms(calls: Sequence[LayerCall]) -> list[Term]:
    """The terms of every call, each call's steps side by side along time."""
    per_call = [call_terms(call) for call in calls]
    return [
        dataclasses.replace(
            parts[0],
            inputs=None
            if parts[0].inputs is None
            else stacked_along_time([p.inputs for p in parts]),
            grads=stacked_along_time([p.grads for p in parts]),
        )
        for parts in zip(*per_call)
    ]


def restricted(value: tf.Tensor, term: Term) -> tf.Tensor:
    """The part of a weight-shaped tensor that `term` covers."""
    if term.row is not None:
        value = value[term.row]
    return value if term.columns is None else value[..., term.columns]


def term_gradient(term: Term) -> tf.Tensor:
    """`(B, in, out)` `Σ_t a_tᵀ δ_t`, or `(B, out)` `Σ_t δ_t` for a bias."""
    if term.inputs is None:
        return tf.reduce_sum(term.grads, axis=1)
    # A batched product with the inputs transposed in the kernel, not copied.
    return tf.linalg.matmul(term.inputs, term.grads, transpose_a=True)


def recurrent_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference, without per-example gradients.

    Example:

    ```python
    # a: (B, T, in), d: (B, T, out)  =>  ||g_i||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s),
    #                                    <g_i, R> = sum_t a_t^T R d_t
    ```
    """
    sq_norms, dots = [], []
    for term in layer_terms(calls):
        part = None if reference is None else restricted(reference(term.variable), term)
        if term.inputs is None:
            grad = tf.reduce_sum(term.grads, axis=1)
            sq_norms.append(sum_of_squares(grad, axis=1, xla=calls[0].xla))
            if part is not None:
                dots.append(tf.linalg.matvec(grad, part))
        else:
            sq_norms.append(sequence_kernel_sq_norm(term.inputs, term.grads, calls[0].xla))
            if part is not None:
                projected = tf.einsum("btd,de->bte", term.inputs, part)
                dots.append(tf.reduce_sum(projected * term.grads, axis=[1, 2]))
    return LayerPrimitives(sq_norm=tf.add_n(sq_norms), dot=tf.add_n(dots) if dots else None)


def recurrent_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, tf.Tensor]]:
    """Per-example gradients of the cell's weights, `(B, *weight.shape)` each."""
    return per_example_gradients(layer_terms(calls), term_gradient)


def recurrent_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """When materializing `Σ_t a_tᵀ δ_t` costs less for both kernels (`rule_math.gram_is_cheaper`,
    with the calls' steps; always for sequences of unknown length)."""
    steps = positions_per_example([call.inputs for call in calls])
    cell = layer.cell
    return all(
        not gram_is_cheaper(steps, *kernel.shape, dots=True)
        for kernel in (cell.kernel, cell.recurrent_kernel)
    )


RECURRENT = Rule(
    "recurrent",
    recurrent_primitives,
    recurrent_applies,
    split_activation=False,
    tap=recurrent_tap,
    per_example=recurrent_per_example,
    materializes=recurrent_materializes,
    covers_sublayers=True,
)
