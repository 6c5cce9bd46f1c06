"""Shared tensor math of the rules."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from keras import ops

from keras_gradtrack import attribution_math, rule_math
from keras_gradtrack.rule_math import GRAM_MAX_TOKENS, EinsumRoles, einsum_canonical
from keras_gradtrack.rules.contract import (
    LayerCall,
    LayerPrimitives,
    PerExampleFn,
    Projection,
    Reference,
    RuleFn,
    primitives_from,
)


def has_plain_weights(layer: Any) -> bool:
    """Whether the layer's weights are plain float variables (no LoRA, no quantization)."""
    return not getattr(layer, "lora_enabled", False) and not getattr(
        layer, "quantization_mode", None
    )


def sum_of_squares(tensor: tf.Tensor, axis: Any = None, xla: bool = False) -> tf.Tensor:
    """`sum x^2` over `axis` (every axis by default) in one pass over the tensor
    (`square` then `reduce_sum` writes and reads a tensor as large as the input).
    `xla`: the step is compiled by XLA, which has no `EuclideanNorm` kernel and fuses
    square and sum by itself (`LayerCall.xla`)."""
    if xla:
        return tf.reduce_sum(tf.square(tensor), axis=axis)
    return tf.square(tf.math.reduce_euclidean_norm(tensor, axis=axis))


def materialized(
    per_example: Sequence[tf.Tensor], references: Sequence[tf.Tensor] | None, xla: bool = False
) -> LayerPrimitives:
    """The primitives from per-example gradients `(B, n)` and their references (any shape,
    n values; None: no dots, as for a step without a `Reference`); `xla` as for
    `sum_of_squares`."""
    sq_norm = tf.add_n([sum_of_squares(g, axis=1, xla=xla) for g in per_example])
    if references is None:
        return LayerPrimitives(sq_norm=sq_norm, dot=None)
    flat_references = [tf.reshape(reference, [-1]) for reference in references]
    return LayerPrimitives(
        sq_norm=sq_norm,
        dot=tf.add_n([tf.linalg.matvec(g, r) for g, r in zip(per_example, flat_references)]),
    )


def references_of(reference: Reference | None, variables: Sequence[Any]) -> list[tf.Tensor] | None:
    """`reference` on each of `variables`, or None for a step without dots."""
    return None if reference is None else [reference(v) for v in variables]


def primitives_of(per_example: PerExampleFn) -> RuleFn:
    """The rule function computing a layer's primitives from its per-example gradients
    (`Rule.from_per_example` builds the whole rule).

    Example:

    ```python
    rule = Rule("scale", primitives_of(scale_per_example), per_example=scale_per_example)
    ```
    """
    return primitives_from(getattr(per_example, "__name__", "per_example"), per_example)


def gram_of(per_example: Sequence[tf.Tensor]) -> tf.Tensor:
    """`(B, B)` `<g_i, g_j>` summed over the given per-example gradients `(B, n)`."""
    return rule_math.per_example_gram(per_example)


def cross_of(per_example: Sequence[tf.Tensor], targets: Sequence[tf.Tensor]) -> tf.Tensor:
    """`(B, T)` `<g_i, h_j>` summed over paired per-example gradients `(B, n)` and `(T, n)`."""
    return attribution_math.paired_products(per_example, targets)


def sketch_of(variable: Any, per_example: tf.Tensor, projection: Projection) -> tf.Tensor:
    """`(B, r_in, r_out)` sketch of a variable's per-example gradients `(B, ...)` (see
    `Projection`): the gradients as `(B, rows, cols)` matrices, projected on both sides."""
    columns = variable.shape[-1] if len(variable.shape) else 1
    matrices = reshape_per_example(per_example, [-1, columns])
    return attribution_math.projected_gradients(
        matrices, projection.rows(variable), projection.columns(variable)
    )


def zero_primitives(like: tf.Tensor, reference: Reference | None) -> LayerPrimitives:
    """Zero primitives for a batch the size of `like`'s first axis (every variable
    frozen); no dot for a step without a `reference`."""
    zeros = tf.zeros([tf.shape(like)[0]], tf.float32)
    return LayerPrimitives(sq_norm=zeros, dot=None if reference is None else zeros)


def summed(terms: Sequence[LayerPrimitives]) -> LayerPrimitives:
    """The primitives of several variables' terms together (dots only if all have one)."""
    dots = [term.dot for term in terms]
    return LayerPrimitives(
        sq_norm=tf.add_n([term.sq_norm for term in terms]),
        dot=None if any(dot is None for dot in dots) else tf.add_n(dots),
    )


def flat_per_example(tensor: tf.Tensor) -> tf.Tensor:
    """`(B, ...)` as `(B, n)`, keeping n static when it is known."""
    return reshape_per_example(tensor, [-1])


def reshape_per_example(tensor: tf.Tensor, dims: Sequence[int]) -> tf.Tensor:
    """Reshapes to `(B, *dims)` keeping every static size static.

    At most one of `dims` is -1. `fit` usually traces with an unknown batch
    size; a plain `tf.reshape(t, [B, -1, d])` would then lose the static size
    of the -1 axis, and the rules choose their cheapest form from static sizes.
    """
    dims = list(dims)
    known = tensor.shape[1:]
    if -1 in dims and known.is_fully_defined():
        others = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(known) // others
    return tf.reshape(tensor, [tf.shape(tensor)[0], *dims])


def along_time(
    calls: Sequence[LayerCall],
    per_call: Callable[[LayerCall], tuple[tf.Tensor, ...]],
    axis: int = 1,
) -> tuple[tf.Tensor, ...]:
    """`per_call`'s tensors of every call, each stacked along time (`axis`): a shared
    layer's calls are one longer sequence to its rules."""
    parts = [per_call(call) for call in calls]
    return tuple(stacked_along_time(list(tensors), axis) for tensors in zip(*parts))


def stacked_along_time(parts: Sequence[tf.Tensor], axis: int = 1) -> tf.Tensor:
    """The calls' tensors side by side along `axis`; one call's as it is."""
    return parts[0] if len(parts) == 1 else tf.concat(list(parts), axis=axis)


def summed_bias_gradient(
    calls: Sequence[LayerCall], bias_shape: Sequence[int], channels_first: bool = False
) -> tf.Tensor:
    """`(B, bias size)`: every call's output gradient summed over the axes a bias is
    broadcast along (added to the trailing axes, or along axis 1 with `channels_first`),
    summed over the calls."""

    def one_call(call: LayerCall) -> tf.Tensor:
        d = tf.cast(call.output_grad, tf.float32)
        if channels_first:
            return tf.reduce_sum(d, axis=list(range(2, d.shape.rank)))
        offset = d.shape.rank - len(bias_shape)
        if offset < 1:
            raise ValueError(
                f"The bias spans the batch axis. Received: bias shape={tuple(bias_shape)}, "
                f"output shape={d.shape}"
            )
        return rule_math.bias_gradients(d, bias_shape)

    return tf.add_n([one_call(call) for call in calls])


def positions_per_example(tensors: Sequence[Any], channels_first: bool = False) -> int | None:
    """Positions per example (every axis but the batch and channel axes), summed over
    the tensors; None if a size is not static."""
    total = 0
    for tensor in tensors:
        shape = tf.convert_to_tensor(tensor).shape
        positions = shape[2:] if channels_first else shape[1:-1]
        if not positions.is_fully_defined():
            return None
        total += math.prod(positions)
    return total


def sequence_kernel_sq_norm(a: tf.Tensor, d: tf.Tensor, xla: bool = False) -> tf.Tensor:
    """`||A_i^T D_i||_F^2` per example for `A` (B, T, in) and `D` (B, T, out), by
    whichever takes fewer multiply-adds (`rule_math.gram_has_fewer_products`):
    `<A_i A_i^T, D_i D_i^T>` or the materialized product (`xla` as for `sum_of_squares`)."""
    if rule_math.gram_has_fewer_products(a.shape[1], a.shape[2], d.shape[2]):
        return rule_math.gram_sq_norms(a, d)
    per_example_kernel = rule_math.dense_kernel_gradients(a, d)
    return sum_of_squares(per_example_kernel, axis=[1, 2], xla=xla)


# Maps a normalization layer's input (float32) and its call to the `(mean, inverse)` it
# normalizes with, `n(x) = (x - mean) * inverse` (mean None: `x * inverse`), each of the
# input's rank and broadcastable to it.
StatisticsFn = Callable[[tf.Tensor, LayerCall], tuple[tf.Tensor | None, tf.Tensor]]
# (layer, one call's float32 output gradient, the call, the axes the scale spans) ->
# the call's `(B, ...)` per-example gradient of the variable multiplying `n(x)`.
ScaleGradientFn = Callable[[Any, tf.Tensor, LayerCall, list[int]], tf.Tensor]


def normalized_axes(layer: Any, axis: int | Sequence[int], rank: int) -> list[int]:
    """`axis` as sorted non-negative ints; raises if it includes the batch axis."""
    axes = sorted(a % rank for a in ([axis] if isinstance(axis, int) else axis))
    if 0 in axes:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) normalizes over the batch "
            "axis, so an example's output depends on the other examples and "
            f"per-example gradients are not defined. Received: axis={axis} for an input "
            f"of rank {rank}"
        )
    return axes


def normalization_per_example(
    scale_gradient: ScaleGradientFn, scale: str, offset: str | None
) -> PerExampleFn:
    """The per-example gradients of a normalization layer, `y = n(x) * scale + offset`
    (both parameters optional, spanning the input axes of `layer.axis`):
    `sum_pos d_i n(x_i)` by `scale_gradient` and `sum_pos d_i` over the other axes.

    Args:
        scale_gradient: One call's gradient of the scale (`scale_of_normalized` or
            `scale_of_moments`).
        scale: The name of the layer's variable multiplying `n(x)`.
        offset: The name of the variable added, or None.
    """

    def per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, tf.Tensor]]:
        scale_variable = getattr(layer, scale, None)
        offset_variable = getattr(layer, offset, None) if offset else None
        scale_variable = (
            scale_variable if scale_variable is not None and scale_variable.trainable else None
        )
        offset_variable = (
            offset_variable if offset_variable is not None and offset_variable.trainable else None
        )
        scale_grads, offset_grads = [], []
        for call in calls:
            d = tf.cast(call.output_grad, tf.float32)
            kept = normalized_axes(layer, layer.axis, call.output_grad.shape.rank)
            if scale_variable is not None:
                scale_grads.append(scale_gradient(layer, d, call, kept))
            if offset_variable is not None:
                offset_grads.append(rule_math.affine_per_example(d, None, kept))
        pairs = [(scale_variable, tf.add_n(scale_grads))] if scale_variable is not None else []
        if offset_variable is not None:
            pairs.append((offset_variable, tf.add_n(offset_grads)))
        return pairs

    return per_example


def scale_of_normalized(normalize: Callable[[Any, Any, Sequence[int]], Any]) -> ScaleGradientFn:
    """The scale's gradient `sum_pos d n(x)` from `normalize(layer, x, axes)`, `n(x)` as the
    layer computes it (`rule_math.layer_normalized`, `rule_math.rms_normalized`)."""

    def scale_gradient(layer: Any, d: tf.Tensor, call: LayerCall, kept: list[int]) -> tf.Tensor:
        # `n(x)` is as large as the input and needs only the input: without this
        # dependency the executor computes it early in the backward pass and holds it
        # until `d` arrives (several normalization layers' at once at the allocator's peak).
        with tf.control_dependencies([d]):
            x = tf.identity(tf.cast(call.inputs, tf.float32))
        return rule_math.affine_per_example(d, normalize(layer, x, kept), kept)

    return scale_gradient


def scale_of_moments(statistics_of: Callable[[Any], StatisticsFn]) -> ScaleGradientFn:
    """The scale's gradient from the layer's moments (`statistics_of(layer)`, as the layer
    computes them), constant over the positions summed per example (GroupNormalization,
    BatchNormalization): `rule_math.scale_from_moments`, no `n(x)` as large as the input."""

    def scale_gradient(layer: Any, d: tf.Tensor, call: LayerCall, kept: list[int]) -> tf.Tensor:
        x = tf.cast(call.inputs, tf.float32)
        mean, inverse = statistics_of(layer)(x, call)
        return rule_math.scale_from_moments(x, d, mean, inverse, kept)

    return scale_gradient


# -- EinsumDense and Embedding calls ------------------------------------------


def roles_of_call(layer: Any, x: tf.Tensor) -> EinsumRoles:
    """The roles of the equation's letters for one call's input `x`; raises where the
    equation has no batch letter first."""
    roles = rule_math.einsum_roles(layer.equation, x.shape.rank)
    if roles is None:
        raise ValueError(
            f"EinsumDense layer {layer.name!r}: the equation has no batch letter first "
            f"in its input and output. Received: equation={layer.equation!r}, input "
            f"shape={x.shape}"
        )
    return roles


def canonical_operands(
    roles_and_operands: Sequence[tuple[EinsumRoles, Any, Any]], kernel_shape: Sequence[int]
) -> tuple[Any, Any]:
    """Every call's input as `(B, S, T, K)` and gradient as `(B, S, T, O)`
    (`rule_math.einsum_canonical`), stacked along T."""
    canonical = [einsum_canonical(roles, kernel_shape, x, d) for roles, x, d in roles_and_operands]
    return (
        stacked_along_time([x for x, _ in canonical], axis=2),
        stacked_along_time([d for _, d in canonical], axis=2),
    )


def canonical_primitives(
    roles: EinsumRoles, x: Any, d: Any, kernel_ref: Any | None, xla: bool
) -> LayerPrimitives:
    """One kernel's primitives from its canonical operands `x` (B, S, T, K) and `d`
    (B, S, T, O), with `kernel_ref` in the kernel's layout (None: no dot): the Gram form
    `<X X^T, D D^T>` or the materialized `X_is^T D_is`, whichever takes fewer products
    (`rule_math.gram_has_fewer_products`)."""
    if kernel_ref is not None:
        kernel_ref = ops.einsum(
            f"{roles.kernel}->{roles.shared}{roles.contracted}{roles.produced}", kernel_ref
        )
        kernel_ref = ops.reshape(kernel_ref, (x.shape[1], x.shape[3], d.shape[3]))
    if rule_math.gram_has_fewer_products(x.shape[2], x.shape[3], d.shape[3]):
        gram_x = ops.einsum("bstk,bsuk->bstu", x, x)
        gram_d = ops.einsum("bsto,bsuo->bstu", d, d)
        sq_norm = ops.sum(gram_x * gram_d, axis=(1, 2, 3))
        dot = None
        if kernel_ref is not None:
            projected = ops.einsum("bstk,sko->bsto", x, kernel_ref)
            dot = ops.sum(projected * d, axis=(1, 2, 3))
        return LayerPrimitives(sq_norm, dot)
    per_example = ops.einsum("bstk,bsto->bsko", x, d)
    sq_norm = sum_of_squares(per_example, axis=[1, 2, 3], xla=xla)
    dot = None if kernel_ref is None else ops.sum(per_example * kernel_ref, axis=(1, 2, 3))
    return LayerPrimitives(sq_norm, dot)


def as_dense_sequences(
    calls: Sequence[LayerCall], layer: Any = None
) -> tuple[tf.Tensor, tf.Tensor]:
    """Stacks every call's input and output gradient as `(B, T, d_in)`, `(B, T, d_out)`.

    `layer`'s kernel gives `d_in` and `d_out` where the static shape lost them (a
    Flatten after a dilated convolution, with the batch size unknown).
    """

    def sequences(call: LayerCall) -> tuple[tf.Tensor, tf.Tensor]:
        a = tf.cast(call.inputs, tf.float32)
        d = tf.cast(call.output_grad, tf.float32)
        if layer is not None and (a.shape[-1] is None or d.shape[-1] is None):
            a = tf.ensure_shape(a, [*a.shape[:-1], layer.kernel.shape[0]])
            d = tf.ensure_shape(d, [*d.shape[:-1], layer.kernel.shape[1]])
        return reshape_per_example(a, [-1, a.shape[-1]]), reshape_per_example(d, [-1, d.shape[-1]])

    a, d = along_time(calls, sequences)
    return a, d


def as_dense_rows(
    calls: Sequence[LayerCall], layer: Any = None
) -> tuple[tf.Tensor, tf.Tensor] | None:
    """One call on 2-D inputs: its input and output gradient `(B, d_in)`, `(B, d_out)`
    as they are (float32), without the sequences' reshapes; otherwise None."""
    if len(calls) != 1 or calls[0].inputs.shape.rank != 2:
        return None
    a = tf.cast(calls[0].inputs, tf.float32)
    d = tf.cast(calls[0].output_grad, tf.float32)
    if layer is not None and (a.shape[-1] is None or d.shape[-1] is None):
        a = tf.ensure_shape(a, [None, layer.kernel.shape[0]])
        d = tf.ensure_shape(d, [None, layer.kernel.shape[1]])
    return a, d


def token_ids(layer: Any, call: LayerCall) -> tf.Tensor:
    """The row indices the layer looked up in this call, as `Embedding.call` computes them."""
    ids = call.inputs
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        raise ValueError(
            f"Embedding layer {layer.name!r} received a {type(ids).__name__}; per-example "
            "gradient statistics support dense integer inputs only (pad the sequences). "
            f"Received: inputs={ids}"
        )
    ids = tf.convert_to_tensor(ids)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    # `ops.take` wraps negative indices around, as numpy does.
    return rule_math.wrapped_ids(ids, layer.input_dim)


def as_token_sequences(layer: Any, calls: Sequence[LayerCall]) -> tuple[tf.Tensor, tf.Tensor]:
    """Stacks every call's ids and output gradients as `(B, T)` int64 and `(B, T, dim)`."""

    def sequences(call: LayerCall) -> tuple[tf.Tensor, tf.Tensor]:
        ids = tf.cast(token_ids(layer, call), tf.int64)
        d = tf.cast(call.output_grad, tf.float32)
        return reshape_per_example(ids, [-1]), reshape_per_example(d, [-1, d.shape[-1]])

    ids, d = along_time(calls, sequences)
    return ids, d


def segment_sq_norm(ids: tf.Tensor, d: tf.Tensor, xla: bool = False) -> tf.Tensor:
    """`sum_v ||sum_{t: id_t = v} d_t||^2` per example, by sorting ids and segment sums.

    Static-shaped (no `tf.unique`), so it also compiles with XLA (`xla`: the step is).
    """
    batch, steps, dim = tf.shape(d)[0], tf.shape(d)[1], tf.shape(d)[2]
    order = tf.argsort(ids, axis=1, stable=True)
    sorted_ids = tf.gather(ids, order, batch_dims=1)
    sorted_d = tf.gather(d, order, batch_dims=1)
    starts_group = tf.not_equal(sorted_ids[:, 1:], sorted_ids[:, :-1])
    starts_group = tf.concat([tf.ones([batch, 1], tf.bool), starts_group], axis=1)
    # Groups of example i are numbered from i * T, so no two examples share one.
    local_group = tf.cumsum(tf.cast(starts_group, tf.int32), axis=1) - 1
    group = local_group + tf.range(batch)[:, None] * steps
    sums = tf.math.unsorted_segment_sum(
        tf.reshape(sorted_d, [-1, dim]), tf.reshape(group, [-1]), batch * steps
    )
    return sum_of_squares(tf.reshape(sums, [batch, -1]), axis=1, xla=xla)


def token_sq_norms(ids: tf.Tensor, d: tf.Tensor, xla: bool = False) -> tf.Tensor:
    """`(B,)` `||g_i||^2` of an Embedding-like gradient (rows `d_t` added at `ids_t`):
    the masked Gram form up to `GRAM_MAX_TOKENS` tokens, sorting and segment sums beyond."""
    steps = ids.shape[1]
    if steps is not None and steps <= GRAM_MAX_TOKENS:
        return rule_math.token_gram_sq_norms(ids, d)
    return segment_sq_norm(ids, d, xla)
