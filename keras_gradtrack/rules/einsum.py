"""Rule for `keras.layers.EinsumDense` (and so MultiHeadAttention's projections).

`EinsumDense` computes `z = einsum(equation, x, kernel) + bias`. Each letter of
the equation other than the batch letter plays one of four roles:

* shared S: in the input, the kernel and the output (a batched kernel axis);
* steps T: in the input and the output only (sequence positions, heads, ...);
* contracted K: in the input and the kernel only;
* produced O: in the kernel and the output only.

Input letters in neither the kernel nor the output are summed over first. With
the input laid out as `X_i` (S, T, K) and the pre-activation gradient as `D_i`
(S, T, O), example i's kernel gradient is, for each s, `X_is^T D_is` (K x O):
the Dense rule on sequences, batched over S. Its squared norm comes from the
Gram form `<X X^T, D D^T>` (cost T^2 (K + O)) or from materializing it (cost
T K O), whichever is cheaper. Several calls of a shared layer are stacked along T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack import rule_math
from keras_gradtrack.rule_math import (
    EinsumRoles,
    einsum_roles,
    gram_has_fewer_products,
    gram_is_cheaper,
)
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule
from keras_gradtrack.rules.ops import (
    has_plain_weights,
    reshape_per_example,
    roles_of_call,
    stacked_along_time,
    sum_of_squares,
    summed_bias_gradient,
)


def einsum_dense_applies(layer: Any) -> bool:
    """The rule covers a plain float EinsumDense whose equation keeps the batch axis first."""
    if not has_plain_weights(layer):
        return False
    input_rank = layer.input_spec.ndim if layer.input_spec is not None else None
    return einsum_roles(layer.equation, input_rank) is not None


def canonical_operands(
    layer: Any, calls: Sequence[LayerCall]
) -> tuple[EinsumRoles, tf.Tensor, tf.Tensor]:
    """Every call's input as `(B, S, T, K)` and gradient as `(B, S, T, O)`, stacked along T."""
    roles = None
    inputs, grads = [], []
    for call in calls:
        x = tf.cast(call.inputs, tf.float32)
        d = tf.cast(call.output_grad, tf.float32)
        roles = roles_of_call(layer, x)
        sizes = dict(zip(roles.kernel, layer.kernel.shape))
        shared = math.prod(sizes[c] for c in roles.shared)
        b, s, t = roles.batch, roles.shared, roles.steps
        x = tf.einsum(f"{roles.input}->{b}{s}{t}{roles.contracted}", x)
        d = tf.einsum(f"{roles.output}->{b}{s}{t}{roles.produced}", d)
        contracted = math.prod(sizes[c] for c in roles.contracted)
        produced = math.prod(sizes[c] for c in roles.produced)
        inputs.append(reshape_per_example(x, [shared, -1, contracted]))
        grads.append(reshape_per_example(d, [shared, -1, produced]))
    assert roles is not None
    return roles, stacked_along_time(inputs, axis=2), stacked_along_time(grads, axis=2)


def einsum_dense_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for an EinsumDense layer.

    Example:

    ```python
    # MultiHeadAttention's query projection "abc,cde->abde": T = b, K = c, O = de, so
    # g_i = X_i^T D_i with X_i (T, dim) and D_i (T, heads * head_dim), as for Dense.
    ```
    """
    batch = tf.shape(tf.convert_to_tensor(calls[0].inputs))[0]
    sq_norm = tf.zeros([batch], tf.float32)
    dot = tf.zeros([batch], tf.float32)
    if layer.kernel.trainable:
        roles, x, d = canonical_operands(layer, calls)
        kernel_ref = None
        if reference is not None:
            kernel_ref = tf.einsum(
                f"{roles.kernel}->{roles.shared}{roles.contracted}{roles.produced}",
                reference(layer.kernel),
            )
            kernel_ref = tf.reshape(kernel_ref, [x.shape[1], x.shape[3], d.shape[3]])
        if gram_has_fewer_products(x.shape[2], x.shape[3], d.shape[3]):
            gram_x = tf.einsum("bstk,bsuk->bstu", x, x)
            gram_d = tf.einsum("bsto,bsuo->bstu", d, d)
            sq_norm += tf.reduce_sum(gram_x * gram_d, axis=[1, 2, 3])
            if kernel_ref is not None:
                projected = tf.einsum("bstk,sko->bsto", x, kernel_ref)
                dot += tf.reduce_sum(projected * d, axis=[1, 2, 3])
        else:
            per_example_kernel = tf.einsum("bstk,bsto->bsko", x, d)
            sq_norm += sum_of_squares(per_example_kernel, axis=[1, 2, 3], xla=calls[0].xla)
            if kernel_ref is not None:
                dot += tf.reduce_sum(per_example_kernel * kernel_ref, axis=[1, 2, 3])
    if layer.bias is not None and layer.bias.trainable:
        bias_grad = summed_bias_gradient(calls, layer.bias.shape)
        sq_norm += sum_of_squares(bias_grad, axis=1, xla=calls[0].xla)
        if reference is not None:
            dot += tf.linalg.matvec(bias_grad, tf.reshape(reference(layer.bias), [-1]))
    return LayerPrimitives(sq_norm=sq_norm, dot=None if reference is None else dot)


def einsum_dense_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """When materializing the per-example kernel gradients `X_is^T D_is` costs less
    than the direct form (`rule_math.gram_is_cheaper` says no)."""
    if not layer.kernel.trainable:
        return True  # only the bias
    steps: int | None = 0
    roles = None
    for call in calls:
        shape = tf.convert_to_tensor(call.inputs).shape
        roles = einsum_roles(layer.equation, shape.rank)
        if roles is None:
            return False  # the primitives explain the equation
        positions = [shape[roles.input.index(c)] for c in roles.steps]
        if steps is not None:
            steps = None if None in positions else steps + math.prod(positions)
    if roles is None:  # no calls
        return False
    sizes = dict(zip(roles.kernel, layer.kernel.shape))
    contracted = math.prod(sizes[c] for c in roles.contracted)
    produced = math.prod(sizes[c] for c in roles.produced)
    return not gram_is_cheaper(steps, contracted, produced, dots=True)


def einsum_dense_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, tf.Tensor]]:
    """Per-example gradients of an EinsumDense layer's kernel (in its own layout,
    `rule_math.einsum_kernel_gradients`, summed over the calls) and bias."""
    pairs = []
    if layer.kernel.trainable:
        grads = []
        for call in calls:
            x = tf.convert_to_tensor(call.inputs)
            roles = roles_of_call(layer, x)
            grads.append(rule_math.einsum_kernel_gradients(roles, x, call.output_grad))
        pairs.append((layer.kernel, tf.add_n(grads)))
    if layer.bias is not None and layer.bias.trainable:
        pairs.append((layer.bias, summed_bias_gradient(calls, layer.bias.shape)))
    return pairs


EINSUM_DENSE = Rule(
    "einsum_dense",
    einsum_dense_primitives,
    einsum_dense_applies,
    per_example=einsum_dense_per_example,
    materializes=einsum_dense_materializes,
)
