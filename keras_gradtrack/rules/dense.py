"""Rule for `keras.layers.Dense` on inputs of any rank.

With `a_i` the input and `d_i = d l_i / d z_i` the gradient at the
pre-activation output, the kernel gradient of example i is `a_i d_i^T` for a
2-D input and `A_i^T D_i` for an input of shape `(T, d_in)` (all leading axes
folded into T; several calls of a shared layer are stacked along T as well).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack.engine.taps import LayerCall
from keras_gradtrack.rules.base import (
    LayerPrimitives,
    Reference,
    gram_is_cheaper,
    materializing_is_cheaper,
    positions_per_example,
    reshape_per_example,
    sum_of_squares,
)


def dense_applies(layer: Any) -> bool:
    """The rule covers a plain float Dense layer with a trainable kernel (no LoRA, no quantization)."""
    return (
        layer.kernel.trainable
        and not getattr(layer, "lora_enabled", False)
        and not getattr(layer, "quantization_mode", None)
    )


def as_sequences(calls: Sequence[LayerCall]) -> tuple[tf.Tensor, tf.Tensor]:
    """Stacks every call's input and output gradient as `(B, T, d_in)`, `(B, T, d_out)`."""
    inputs, grads = [], []
    for call in calls:
        a = tf.cast(call.inputs, tf.float32)
        d = tf.cast(call.output_grads[0], tf.float32)
        inputs.append(reshape_per_example(a, [-1, a.shape[-1]]))
        grads.append(reshape_per_example(d, [-1, d.shape[-1]]))
    if len(calls) == 1:
        return inputs[0], grads[0]
    return tf.concat(inputs, axis=1), tf.concat(grads, axis=1)


def sequence_kernel_sq_norm(a: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
    """`||A_i^T D_i||_F^2` per example, by whichever form costs less (`gram_is_cheaper`)."""
    if gram_is_cheaper(a.shape[1], a.shape[2], d.shape[2]):
        gram_a = tf.einsum("btd,bsd->bts", a, a)
        gram_d = tf.einsum("bte,bse->bts", d, d)
        return tf.reduce_sum(gram_a * gram_d, axis=[1, 2])
    per_example_kernel = tf.einsum("btd,bte->bde", a, d)
    return sum_of_squares(per_example_kernel, axis=[1, 2])


def dense_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for a Dense layer.

    Example:

    ```python
    # a: (B, d_in), d: (B, d_out)  =>  ||g_i||^2 = ||a_i||^2 ||d_i||^2,
    #                                  <g_i, R> = a_i^T R d_i
    ```
    """
    a, d = as_sequences(calls)
    has_bias = layer.bias is not None and layer.bias.trainable
    if a.shape[1] == 1:
        variables = [layer.kernel, layer.bias] if has_bias else [layer.kernel]
        return dense_2d_primitives(a[:, 0, :], d[:, 0, :], variables, reference)
    sq_norm = sequence_kernel_sq_norm(a, d)
    dot = tf.reduce_sum(tf.einsum("btd,de->bte", a, reference(layer.kernel)) * d, axis=[1, 2])
    if has_bias:
        bias_grad = tf.reduce_sum(d, axis=1)
        sq_norm += sum_of_squares(bias_grad, axis=1)
        dot += tf.linalg.matvec(bias_grad, reference(layer.bias))
    return LayerPrimitives(sq_norm=sq_norm, dot=dot)


def dense_2d_primitives(
    a: tf.Tensor, d: tf.Tensor, variables: Sequence[Any], reference: Reference
) -> LayerPrimitives:
    """The primitives of a Dense layer on 2-D inputs `a` (B, d_in), `d` (B, d_out).

    `variables` is the kernel, then the bias if it is trained. Directly:
    `||g_i||^2 = (||a_i||^2 + 1) ||d_i||^2` and `<g_i, R> = (a_i^T R_kernel + R_bias) . d_i`,
    one product the size of the layer's forward pass. Where R is the sum of the
    per-example gradients, from the Gram matrix `<g_i, g_j> = (a_i . a_j + 1)(d_i . d_j)`
    instead (its row sums are the dots) when `B (d_in + d_out) < d_in d_out`; for an
    unknown batch size the step chooses at run time.
    """
    has_bias = len(variables) == 2

    def direct() -> tuple[tf.Tensor, tf.Tensor]:
        a_sq = sum_of_squares(a, axis=1)
        projected = tf.matmul(a, reference(variables[0]))
        if has_bias:
            a_sq += 1.0
            projected = tf.nn.bias_add(projected, reference(variables[1]))
        return a_sq * sum_of_squares(d, axis=1), tf.reduce_sum(projected * d, axis=1)

    def from_gram() -> tuple[tf.Tensor, tf.Tensor]:
        gram = dense_2d_gram(a, d, has_bias)
        return tf.linalg.diag_part(gram), tf.reduce_sum(gram, axis=1)

    d_in, d_out = a.shape[-1], d.shape[-1]
    if not reference.is_batch_sum(variables):
        sq_norm, dot = direct()
    elif a.shape[0] is not None:
        sq_norm, dot = from_gram() if gram_is_cheaper(a.shape[0], d_in, d_out) else direct()
    else:
        sq_norm, dot = tf.cond(gram_is_cheaper(tf.shape(a)[0], d_in, d_out), from_gram, direct)
    return LayerPrimitives(sq_norm=sq_norm, dot=dot)


def dense_2d_gram(a: tf.Tensor, d: tf.Tensor, has_bias: bool) -> tf.Tensor:
    """`(B, B)` `<g_i, g_j> = (a_i . a_j (+ 1 with a bias)) (d_i . d_j)`."""
    gram_a = tf.matmul(a, a, transpose_b=True)
    if has_bias:
        gram_a += 1.0
    return gram_a * tf.matmul(d, d, transpose_b=True)


def dense_gram(layer: Any, calls: Sequence[LayerCall]) -> tf.Tensor:
    """`(B, B)` Gram matrix of a Dense layer's per-example gradients.

    On 2-D inputs `<g_i, g_j> = (a_i . a_j)(d_i . d_j) (+ d_i . d_j for the bias)`;
    on sequences the per-example kernel gradients are materialized.
    """
    a, d = as_sequences(calls)
    has_bias = layer.bias is not None and layer.bias.trainable
    if a.shape[1] == 1:
        return dense_2d_gram(a[:, 0, :], d[:, 0, :], has_bias)
    per_example_kernel = tf.einsum("btd,bte->bde", a, d)
    batch = tf.shape(a)[0]
    flat = tf.reshape(per_example_kernel, [batch, -1])
    gram = tf.matmul(flat, flat, transpose_b=True)
    if has_bias:
        bias_grad = tf.reduce_sum(d, axis=1)
        gram += tf.matmul(bias_grad, bias_grad, transpose_b=True)
    return gram


def dense_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """On sequences, when materializing `A_i^T D_i` costs less than the direct form
    (`materializing_is_cheaper`); never on 2-D inputs, where `||a_i||^2 ||d_i||^2`
    costs nothing."""
    steps = positions_per_example([call.inputs for call in calls])
    d_in, d_out = layer.kernel.shape
    return steps != 1 and materializing_is_cheaper(steps, d_in, d_out)


def dense_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, tf.Tensor]]:
    """Per-example gradients of a Dense layer's kernel `A_i^T D_i` and bias `sum_t D_i`."""
    a, d = as_sequences(calls)
    pairs = [(layer.kernel, tf.einsum("btd,bte->bde", a, d))]
    if layer.bias is not None and layer.bias.trainable:
        pairs.append((layer.bias, tf.reduce_sum(d, axis=1)))
    return pairs
