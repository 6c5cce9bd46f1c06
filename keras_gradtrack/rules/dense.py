"""Rule for `keras.layers.Dense` on inputs of any rank.

With `a_i` the input and `d_i = d l_i / d z_i` the gradient at the
pre-activation output, the kernel gradient of example i is `a_i d_i^T` for a
2-D input and `A_i^T D_i` for an input of shape `(T, d_in)` (all leading axes
folded into T; several calls of a shared layer are stacked along T as well).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack import attribution_math, rule_math
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Projection, Reference, Rule
from keras_gradtrack.rules.ops import (
    as_dense_rows,
    as_dense_sequences,
    cross_of,
    flat_per_example,
    gram_of,
    has_plain_weights,
    materialized,
    positions_per_example,
    references_of,
    sequence_kernel_sq_norm,
    sum_of_squares,
    summed,
    summed_bias_gradient,
    zero_primitives,
)


def dense_applies(layer: Any) -> bool:
    """The rule covers a Dense layer with plain float weights (no LoRA, no quantization);
    a frozen kernel or bias is simply left out."""
    return has_plain_weights(layer)


def trained_variables(layer: Any) -> tuple[Any | None, Any | None]:
    """`(kernel, bias)`, each None unless it is trained."""
    kernel = layer.kernel if layer.kernel.trainable else None
    bias = layer.bias if layer.bias is not None and layer.bias.trainable else None
    return kernel, bias


def dense_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for a Dense layer.

    On 2-D inputs (one step per example) by `dense_2d_primitives`; on sequences, the
    kernel's squared norm by `sequence_kernel_sq_norm` (Gram matrices or the
    materialized product, whichever costs less) and the bias's from its sum over time.

    Example:

    ```python
    # a: (B, d_in), d: (B, d_out)  =>  ||g_i||^2 = ||a_i||^2 ||d_i||^2,
    #                                  <g_i, R> = a_i^T R d_i
    ```
    """
    kernel, bias = trained_variables(layer)
    rows = as_dense_rows(calls, layer)
    if rows is not None:
        return dense_2d_primitives(*rows, kernel, bias, reference, calls[0].xla)
    a, d = as_dense_sequences(calls, layer)
    if a.shape[1] == 1:
        return dense_2d_primitives(a[:, 0, :], d[:, 0, :], kernel, bias, reference, calls[0].xla)
    terms = []
    if kernel is not None:
        dot = None
        if reference is not None:
            projected = ops.einsum("btd,de->bte", a, reference(kernel))
            dot = ops.sum(projected * d, axis=(1, 2))
        terms.append(LayerPrimitives(sq_norm=sequence_kernel_sq_norm(a, d, calls[0].xla), dot=dot))
    if bias is not None:
        bias_grad = summed_bias_gradient(calls, bias.shape)
        terms.append(materialized([bias_grad], references_of(reference, [bias]), calls[0].xla))
    if not terms:
        return zero_primitives(d, reference)
    return summed(terms)


def dense_2d_primitives(
    a: Any,
    d: Any,
    kernel: Any | None,
    bias: Any | None,
    reference: Reference | None,
    xla: bool = False,
) -> LayerPrimitives:
    """The primitives of a Dense layer on 2-D inputs `a` (B, d_in), `d` (B, d_out).

    `kernel` and `bias` are the trained variables (None when frozen); `xla`: the step
    is compiled by XLA (`LayerCall.xla`). Directly:
    `||g_i||^2 = (||a_i||^2 + 1) ||d_i||^2` and `<g_i, R> = (a_i^T R_kernel + R_bias) . d_i`,
    one product the size of the layer's forward pass. Where R is the sum of the
    per-example gradients, from the Gram matrix `<g_i, g_j> = (a_i . a_j + 1)(d_i . d_j)`
    instead (its row sums are the dots) when `B (d_in + d_out) < d_in d_out`; for an
    unknown batch size the step chooses at run time.
    """
    variables = [v for v in (kernel, bias) if v is not None]
    if reference is None:  # norms only: `(||a_i||^2 + 1) ||d_i||^2`, no product
        input_sq = sum_of_squares(a, axis=1, xla=xla) if kernel is not None else 0.0
        if bias is not None:
            input_sq += 1.0
        return LayerPrimitives(input_sq * sum_of_squares(d, axis=1, xla=xla), None)

    def direct() -> tuple[Any, Any]:
        input_sq = ops.zeros((ops.shape(d)[0],), "float32")
        projected = ops.zeros_like(d)
        if kernel is not None:
            input_sq = sum_of_squares(a, axis=1, xla=xla)
            projected = ops.matmul(a, reference(kernel))
        if bias is not None:
            input_sq += 1.0
            projected = projected + reference(bias)
        return input_sq * sum_of_squares(d, axis=1, xla=xla), ops.sum(projected * d, axis=1)

    def from_gram() -> tuple[Any, Any]:
        gram = dense_2d_gram(a, d, kernel is not None, bias is not None)
        return ops.diagonal(gram, axis1=-2, axis2=-1), ops.sum(gram, axis=1)

    d_in, d_out = a.shape[-1], d.shape[-1]
    if kernel is None or not reference.is_batch_sum(variables):
        sq_norm, dot = direct()
    elif a.shape[0] is not None:
        sq_norm, dot = (
            from_gram() if rule_math.gram_has_fewer_products(a.shape[0], d_in, d_out) else direct()
        )
    else:
        sq_norm, dot = ops.cond(
            rule_math.gram_has_fewer_products(ops.shape(a)[0], d_in, d_out), from_gram, direct
        )
    return LayerPrimitives(sq_norm=sq_norm, dot=dot)


def dense_2d_gram(a: Any, d: Any, has_kernel: bool, has_bias: bool) -> Any:
    """`(B, B)` `<g_i, g_j> = (a_i . a_j (+ 1 with a bias)) (d_i . d_j)`."""
    return dense_2d_cross(a, d, a, d, has_kernel, has_bias)


def dense_2d_cross(a: Any, d: Any, a2: Any, d2: Any, has_kernel: bool, has_bias: bool) -> Any:
    """`(B, T)` `<g_i, h_j> = (a_i . a2_j (+ 1 with a bias)) (d_i . d2_j)`."""
    return rule_math.dense_cross(a, d, a2, d2, has_kernel, has_bias)


def dense_gram(layer: Any, calls: Sequence[LayerCall]) -> Any:
    """`(B, B)` Gram matrix of a Dense layer's per-example gradients.

    On 2-D inputs `<g_i, g_j> = (a_i . a_j)(d_i . d_j) (+ d_i . d_j for the bias)`;
    on sequences from the per-example gradients.
    """
    kernel, bias = trained_variables(layer)
    rows = as_dense_rows(calls, layer)
    if rows is not None:
        return dense_2d_gram(*rows, kernel is not None, bias is not None)
    a, d = as_dense_sequences(calls, layer)
    if a.shape[1] == 1:
        return dense_2d_gram(a[:, 0, :], d[:, 0, :], kernel is not None, bias is not None)
    return gram_of([flat_per_example(g) for _, g in dense_per_example(layer, calls)])


def dense_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """On sequences, when materializing `A_i^T D_i` costs less than the direct form
    (`rule_math.gram_is_cheaper` says no), or when only the bias is trained; never on 2-D
    inputs, where `||a_i||^2 ||d_i||^2` costs nothing."""
    steps = positions_per_example([call.inputs for call in calls])
    if steps == 1:
        return False
    d_in, d_out = layer.kernel.shape
    return not layer.kernel.trainable or not rule_math.gram_is_cheaper(
        steps, d_in, d_out, dots=True
    )


def dense_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of a Dense layer's kernel `A_i^T D_i` and bias `sum_t D_i`."""
    a, d = as_dense_sequences(calls, layer)
    kernel, bias = trained_variables(layer)
    pairs = []
    if kernel is not None:
        pairs.append((kernel, rule_math.dense_kernel_gradients(a, d)))
    if bias is not None:
        pairs.append((bias, summed_bias_gradient(calls, bias.shape)))
    return pairs


def dense_cross(layer: Any, calls: Sequence[LayerCall], target_calls: Sequence[LayerCall]) -> Any:
    """`(B, T)` products of a Dense layer's per-example gradients with other examples'.

    On 2-D inputs `<g_i, h_j> = (a_i . a'_j + 1) (d_i . d'_j)` (the `+ 1` with a bias),
    never building a gradient; on sequences from the per-example gradients.
    """
    a, d = as_dense_sequences(calls)
    a2, d2 = as_dense_sequences(target_calls)
    kernel, bias = trained_variables(layer)
    if a.shape[1] == 1 and a2.shape[1] == 1:
        return dense_2d_cross(
            a[:, 0, :], d[:, 0, :], a2[:, 0, :], d2[:, 0, :], kernel is not None, bias is not None
        )
    pairs, target_pairs = dense_per_example(layer, calls), dense_per_example(layer, target_calls)
    return cross_of(
        [flat_per_example(g) for _, g in pairs], [flat_per_example(h) for _, h in target_pairs]
    )


def dense_sketch(
    layer: Any, calls: Sequence[LayerCall], projection: Projection
) -> list[tuple[Any, Any]]:
    """Sketches of a Dense layer's per-example gradients from its factors.

    Kernel: `sum_t (R^T a_it)(C^T d_it)^T`, never `a_it d_it^T` itself; bias: `sum_t C^T d_it`.
    """
    a, d = as_dense_sequences(calls)
    kernel, bias = trained_variables(layer)
    pairs = []
    if kernel is not None:
        rows, columns = projection.rows(kernel), projection.columns(kernel)
        pairs.append((kernel, attribution_math.factor_sketches(a, d, rows, columns)))
    if bias is not None:
        rows, columns = projection.rows(bias), projection.columns(bias)
        pairs.append((bias, attribution_math.bias_sketches(d, rows, columns)))
    return pairs


DENSE = Rule(
    "dense",
    dense_primitives,
    dense_applies,
    gram=dense_gram,
    per_example=dense_per_example,
    materializes=dense_materializes,
    cross=dense_cross,
    sketch=dense_sketch,
)
