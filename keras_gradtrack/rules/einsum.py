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

from keras import ops

from keras_gradtrack import rule_math
from keras_gradtrack.rule_math import einsum_roles, gram_is_cheaper
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule
from keras_gradtrack.rules.ops import (
    canonical_operands,
    canonical_primitives,
    has_plain_weights,
    materialized,
    references_of,
    roles_of_call,
    summed,
    summed_bias_gradient,
    zero_primitives,
)


def einsum_dense_applies(layer: Any) -> bool:
    """The rule covers a plain float EinsumDense whose equation keeps the batch axis first."""
    if not has_plain_weights(layer):
        return False
    input_rank = layer.input_spec.ndim if layer.input_spec is not None else None
    return einsum_roles(layer.equation, input_rank) is not None


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
    xla = calls[0].xla
    terms = []
    if layer.kernel.trainable:
        operands = []
        for call in calls:
            x = ops.convert_to_tensor(call.inputs)
            operands.append((roles_of_call(layer, x), x, call.output_grad))
        x, d = canonical_operands(operands, layer.kernel.shape)
        kernel_ref = None if reference is None else reference(layer.kernel)
        terms.append(canonical_primitives(operands[0][0], x, d, kernel_ref, xla))
    if layer.bias is not None and layer.bias.trainable:
        bias_grad = summed_bias_gradient(calls, layer.bias.shape)
        terms.append(materialized([bias_grad], references_of(reference, [layer.bias]), xla))
    if not terms:
        return zero_primitives(ops.convert_to_tensor(calls[0].inputs), reference)
    return summed(terms)


def einsum_dense_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """When materializing the per-example kernel gradients `X_is^T D_is` costs less
    than the direct form (`rule_math.gram_is_cheaper` says no)."""
    if not layer.kernel.trainable:
        return True  # only the bias
    steps: int | None = 0
    roles = None
    for call in calls:
        shape = ops.convert_to_tensor(call.inputs).shape
        roles = einsum_roles(layer.equation, len(shape))
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


def einsum_dense_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of an EinsumDense layer's kernel (in its own layout,
    `rule_math.einsum_kernel_gradients`, summed over the calls) and bias."""
    pairs = []
    if layer.kernel.trainable:
        grads = []
        for call in calls:
            x = ops.convert_to_tensor(call.inputs)
            roles = roles_of_call(layer, x)
            grads.append(rule_math.einsum_kernel_gradients(roles, x, call.output_grad))
        pairs.append((layer.kernel, rule_math.total(grads)))
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
