"""The per-example math of the rules both engines share, in `keras.ops` only: the cost
model, Dense, EinsumDense, Embedding, the convolutions and the normalizations.

Nothing here imports TensorFlow or JAX: an engine brings what is its own (how it
records a layer's inputs and output gradients, how it cuts a convolution's input
into windows, its kernel choices; docs/architecture.md, "What is backend-neutral")
and calls these functions for the math, which any Keras backend runs. Results are
float32 (the functions cast their inputs where they take a layer's tensors).

Notation: `B` examples, `P` output positions per example, `C` input channels,
`F` output channels (filters), `K` kernel offsets (the product of the kernel size).

Example:

```python
windows = [x_window(offset) for offset in kernel_offsets]   # K tensors (B, *spatial, C)
grads = kernel_gradients(windows, d, groups=1)              # (B, K, C, F)
```
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

# Materializing per-example gradients of at most this many values per example is
# weighed against the Gram form; larger ones are materialized only where the Gram
# form costs more (`gram_is_cheaper`, both engines' cost model).
MATERIALIZE_MAX_VALUES = 2**16
# One pass over a tensor, in multiply-adds of a matrix product of the same time (a
# CPU calibration, docs/performance.md), times the passes a materialized gradient
# takes (sum, norm, dot).
MATERIALIZED_PASS_COST = 16
# Up to this many tokens per example, an Embedding's masked Gram form (T^2 dim, a dense
# product) is as fast as sorting and segment sums (T dim, but a scatter); beyond it the
# Gram form, quadratic in T in time and memory, loses quickly (docs/performance.md).
GRAM_MAX_TOKENS = 32


def f32(value: Any) -> Any:
    return ops.cast(value, "float32")


def gram_has_fewer_products(positions: Any, width_in: int, width_out: int) -> Any:
    """Whether the Gram form `<X_i X_i^T, D_i D_i^T>` of `||X_i^T D_i||^2` takes fewer
    multiply-adds (`P^2 (in + out)`) than the product `X_i^T D_i` (`P in out`), for
    `X_i` (P x in) and `D_i` (P x out).

    False when P is unknown (None); a boolean tensor when P is a scalar tensor (a size
    known only at run time, for an engine's conditional).
    """
    return positions is not None and positions * (width_in + width_out) < width_in * width_out


def gram_is_cheaper(
    positions: int | None, width_in: int, width_out: int, dots: bool, groups: int = 1
) -> bool:
    """Whether the Gram form serves `||X_i^T D_i||^2` (and, with `dots`, `<X_i^T D_i, R>`
    as `sum <X_i R, D_i>`) at less cost than materializing `X_i^T D_i`, for `X_i`
    (P x in) and `D_i` (P x out) per group of channels.

    The Gram form costs `P^2 (in + out)` per example, plus `P in out` for the dot with
    a reference (`dots`); materializing costs `P in out` (replacing the backward pass'
    weight gradient), then a few passes over its `in out` values, and holds `B in out`
    of them per group. Per-example gradients of more than `MATERIALIZE_MAX_VALUES`
    values (over all `groups`) are materialized only where the Gram form takes more
    multiply-adds. False when P is unknown (None).
    """
    if positions is None or not gram_has_fewer_products(positions, width_in, width_out):
        return False
    values = width_in * width_out
    gram = positions**2 * (width_in + width_out) + (positions * values if dots else 0)
    return groups * values > MATERIALIZE_MAX_VALUES or gram <= MATERIALIZED_PASS_COST * values


def gram_sq_norms(a: Any, d: Any) -> Any:
    """`(B,)` `||A_i^T D_i||_F^2 = <A_i A_i^T, D_i D_i^T>` for `a` (B, P, in) and `d`
    (B, P, out), never building `A_i^T D_i` (cost `P^2 (in + out)` per example)."""
    gram_a = ops.einsum("bpc,bqc->bpq", a, a)
    gram_d = ops.einsum("bpf,bqf->bpq", d, d)
    return ops.sum(gram_a * gram_d, axis=(1, 2))


def per_example_gram(per_example: Sequence[Any]) -> Any:
    """`(B, B)` `<g_i, g_j>` summed over the given flat per-example gradients `(B, n)`."""
    grams = [ops.matmul(g, ops.transpose(g)) for g in per_example]
    return sum(grams[1:], grams[0])


# -- Dense, Embedding ----------------------------------------------------------


def dense_kernel_gradients(a: Any, d: Any) -> Any:
    """`(B, in, out)` per-example kernel gradients `A_i^T D_i` of a Dense layer, for its
    input `a` (B, T, in) and output gradient `d` (B, T, out) (T: the positions)."""
    return ops.einsum("bti,bto->bio", a, d)


def dense_cross(a: Any, d: Any, a2: Any, d2: Any, has_kernel: bool, has_bias: bool) -> Any:
    """`(B, T)` `<g_i, h_j> = (a_i . a2_j (+ 1 with a bias)) (d_i . d2_j)`: the products of
    a Dense layer's per-example gradients on 2-D inputs, `g_i = a_i d_i^T` (and `d_i` for
    the bias), with `h_j = a2_j d2_j^T`, never building them (`a2, d2 = a, d`: the Gram
    matrix)."""
    cross_d = ops.matmul(d, ops.transpose(d2))
    cross_a = ops.matmul(a, ops.transpose(a2)) if has_kernel else ops.zeros_like(cross_d)
    if has_bias:
        cross_a = cross_a + 1.0
    return cross_a * cross_d


def bias_gradients(output_grad: Any, bias_shape: Sequence[int]) -> Any:
    """`(B, bias size)`: example i's gradient of a bias added to the output's trailing
    axes, `d_i` summed over the other non-batch axes and those the bias is broadcast
    along (its axes of size one)."""
    d = f32(output_grad)
    offset = len(d.shape) - len(bias_shape)
    broadcast = [offset + j for j, size in enumerate(bias_shape) if size == 1]
    summed = ops.sum(d, axis=list(range(1, offset)) + broadcast)
    return ops.reshape(summed, [ops.shape(d)[0], -1])


def wrapped_ids(ids: Any, rows: int) -> Any:
    """Token ids with the negative ones wrapped around, as `ops.take` looks them up."""
    return ops.where(ids < 0, ids + ops.cast(rows, ids.dtype), ids)


def token_gram_sq_norms(ids: Any, d: Any) -> Any:
    """`(B,)` `||g_i||^2` of an Embedding's per-example gradient, for its token ids `ids`
    (B, T) and output gradient `d` (B, T, dim): example i adds `d_it` to row `id_it`, so
    `||g_i||^2 = sum_{t,s: id_t = id_s} <d_t, d_s>` (cost `T^2 dim`; ids wrapped)."""
    same_id = ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), d.dtype)
    gram = ops.einsum("btd,bsd->bts", d, d)
    return ops.sum(same_id * gram, axis=(1, 2))


def token_segment_sq_norms(ids: Any, d: Any) -> Any:
    """`(B,)` `||g_i||^2` of an Embedding's per-example gradient, as `token_gram_sq_norms`,
    by sorting each example's ids and summing `d` over the runs of equal ids: cost `T
    log T + T dim`, and nothing larger than `d` is held (no `(T, T)` matrix). The
    shapes of `ids` (B, T) and `d` (B, T, dim) must be static.

    Example:

    ```python
    # ids_i = [3, 7, 3]: sorted [3, 3, 7], runs [0, 0, 1]
    # ||g_i||^2 = ||d_0 + d_2||^2 + ||d_1||^2
    ```
    """
    batch, steps, dim = d.shape
    offsets = ops.arange(batch, dtype="int32")[:, None] * steps  # example i's runs from i T
    order = ops.cast(ops.argsort(ids, axis=1), "int32")
    sorted_ids = ops.take_along_axis(ids, order, axis=1)
    sorted_d = ops.take(
        ops.reshape(d, (batch * steps, dim)), ops.reshape(order + offsets, (-1,)), axis=0
    )
    starts_run = ops.cast(ops.not_equal(sorted_ids[:, 1:], sorted_ids[:, :-1]), "int32")
    starts_run = ops.concatenate([ops.ones((batch, 1), "int32"), starts_run], axis=1)
    runs = ops.cumsum(starts_run, axis=1) - 1 + offsets
    sums = ops.segment_sum(sorted_d, ops.reshape(runs, (-1,)), num_segments=batch * steps)
    return ops.sum(ops.reshape(ops.square(sums), (batch, -1)), axis=1)


def token_dots(ids: Any, d: Any, table_reference: Any) -> Any:
    """`(B,)` `<g_i, R> = sum_t <d_t, R[id_t]>` of an Embedding (as `token_gram_sq_norms`),
    a lookup of the reference's rows: no `(vocabulary, dim)` gradient."""
    return ops.sum(ops.take(table_reference, ids, axis=0) * d, axis=(1, 2))


# -- EinsumDense ----------------------------------------------------------------
#
# `z = einsum(equation, x, kernel) + bias`. Each letter other than the batch letter
# plays one of four roles: shared S (input, kernel and output: a batched kernel
# axis), steps T (input and output only), contracted K (input and kernel only),
# produced O (kernel and output only); input letters in neither the kernel nor the
# output are summed over first.

EQUATION = re.compile(r"^([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)$")


@dataclasses.dataclass(frozen=True)
class EinsumRoles:
    """The letters of an EinsumDense equation, by role (see this section's comment).

    Attributes:
        input: Input subscripts, any ellipsis spelled out.
        kernel: Kernel subscripts.
        output: Output subscripts, any ellipsis spelled out.
        batch: The batch letter (first of input and output, not in the kernel).
        shared: S letters, in kernel order.
        steps: T letters, in input order.
        contracted: K letters, in kernel order.
        produced: O letters, in kernel order.
    """

    input: str
    kernel: str
    output: str
    batch: str
    shared: str
    steps: str
    contracted: str
    produced: str


def expand_ellipsis(equation: str, input_rank: int | None) -> tuple[str, str, str] | None:
    """The equation's three subscripts with `...` replaced by fresh letters, or None."""
    match = EQUATION.match(equation.replace(" ", ""))
    if match is None:
        return None
    inputs, kernel, output = match.groups()
    if "..." not in inputs and "..." not in output:
        return (inputs, kernel, output) if "." not in inputs + output else None
    if inputs.count("...") != 1 or output.count("...") != 1 or input_rank is None:
        return None
    elided = input_rank - (len(inputs) - 3)
    fresh = [c for c in string.ascii_letters if c not in equation]
    if elided < 0 or elided > len(fresh) or "." in inputs.replace("...", "", 1):
        return None
    letters = "".join(fresh[:elided])
    return inputs.replace("...", letters), kernel, output.replace("...", letters)


def einsum_roles(equation: str, input_rank: int | None) -> EinsumRoles | None:
    """The roles of the equation's letters, or None if it has no clear batch letter."""
    expanded = expand_ellipsis(equation, input_rank)
    if expanded is None:
        return None
    inputs, kernel, output = expanded
    if any(len(set(spec)) != len(spec) for spec in expanded) or not inputs or not output:
        return None
    batch = inputs[0]
    if output[0] != batch or batch in kernel:
        return None
    if any(c not in inputs + output for c in kernel) or any(
        c not in inputs + kernel for c in output
    ):
        return None
    return EinsumRoles(
        input=inputs,
        kernel=kernel,
        output=output,
        batch=batch,
        shared="".join(c for c in kernel if c in inputs and c in output),
        steps="".join(c for c in inputs[1:] if c in output and c not in kernel),
        contracted="".join(c for c in kernel if c in inputs and c not in output),
        produced="".join(c for c in kernel if c in output and c not in inputs),
    )


def einsum_canonical(
    roles: EinsumRoles, kernel_shape: Sequence[int], x: Any, d: Any
) -> tuple[Any, Any]:
    """An EinsumDense's input as `(B, S, T, K)` and output gradient as `(B, S, T, O)`
    (float32, the letters of each role flattened), for `kernel_shape` of `roles.kernel`:
    example i's kernel gradient is then `X_is^T D_is` for each s, a Dense one."""
    sizes = dict(zip(roles.kernel, kernel_shape))
    b, s, t = roles.batch, roles.shared, roles.steps
    x = ops.einsum(f"{roles.input}->{b}{s}{t}{roles.contracted}", f32(x))
    d = ops.einsum(f"{roles.output}->{b}{s}{t}{roles.produced}", f32(d))
    shared = math.prod(sizes[c] for c in s)
    contracted = math.prod(sizes[c] for c in roles.contracted)
    produced = math.prod(sizes[c] for c in roles.produced)
    positions = [x.shape[1 + len(s) + j] for j in range(len(t))]
    if None in positions:
        batch = ops.shape(x)[0]
        return (
            ops.reshape(x, (batch, shared, -1, contracted)),
            ops.reshape(d, (batch, shared, -1, produced)),
        )
    steps = math.prod(positions)
    return (
        ops.reshape(x, (-1, shared, steps, contracted)),
        ops.reshape(d, (-1, shared, steps, produced)),
    )


def einsum_kernel_gradients(roles: EinsumRoles, x: Any, d: Any) -> Any:
    """`(B, *kernel.shape)` per-example kernel gradients of an EinsumDense layer, for its
    input `x` and output gradient `d` laid out as the equation says: one einsum of the
    two over every letter the kernel does not have."""
    equation = f"{roles.input},{roles.output}->{roles.batch}{roles.kernel}"
    return ops.einsum(equation, f32(x), f32(d))


# -- convolutions -------------------------------------------------------------


def _positions(tensor: Any) -> Any:
    """`(B, *spatial, C)` as `(B, P, C)`."""
    return ops.reshape(f32(tensor), (tensor.shape[0], -1, tensor.shape[-1]))


def kernel_gradients(windows: Sequence[Any], output_grad: Any, groups: int = 1) -> Any:
    """Per-example kernel gradients of a (grouped) convolution: `g_i[k] = S_ik^T D_i`
    per group of channels.

    Args:
        windows: One `(B, *spatial, C)` tensor per kernel offset k: `S_ik[p]`, example
            i's input under offset k of the kernel when it sits at output position p.
        output_grad: `(B, *spatial, F)`, example i's gradient at the layer's output.
        groups: The channel groups: output channel f sees the `C / groups` input
            channels of group `f // (F / groups)` (a depthwise convolution with
            multiplier M has C groups and `F = C M`).

    Returns:
        `(B, K, C / groups, F)`, the kernel's layout with its spatial axes flattened.
    """
    d = f32(output_grad)
    batch, *spatial, filters = d.shape
    # The positions stay as the windows lay them out (a reshape would copy each window).
    axes = "hijklmn"[: len(spatial)]
    per_offset = []
    for window in windows:
        s = f32(window)
        channels = s.shape[-1]
        if groups == 1:
            per_offset.append(ops.einsum(f"b{axes}c,b{axes}f->bcf", s, d))
            continue
        s = ops.reshape(s, (batch, *spatial, groups, channels // groups))
        grouped = ops.reshape(d, (batch, *spatial, groups, filters // groups))
        g = ops.einsum(f"b{axes}gc,b{axes}gf->bcgf", s, grouped)
        per_offset.append(ops.reshape(g, (batch, channels // groups, filters)))
    return ops.stack(per_offset, axis=1)


def kernel_gram_sq_norms(windows: Sequence[Any], output_grad: Any) -> Any:
    """`(B,)` `||g_i||^2` of an ungrouped convolution's kernel without building `g_i`:
    `sum_{p,q} (sum_k <S_ik[p], S_ik[q]>) <D_i[p], D_i[q]>`."""
    stacked = ops.concatenate([_positions(w) for w in windows], axis=-1)  # (B, P, K C)
    return gram_sq_norms(stacked, _positions(output_grad))


def kernel_dots(windows: Sequence[Any], output_grad: Any, kernel_ref: Any) -> Any:
    """`(B,)` `<g_i, R> = sum_k <S_ik R_k, D_i>` of an ungrouped convolution, for R
    laid out `(K, C, F)`, without building `g_i`."""
    d = _positions(output_grad)
    dots = 0.0
    for k, window in enumerate(windows):
        dots = dots + ops.sum(ops.matmul(_positions(window), kernel_ref[k]) * d, axis=(1, 2))
    return dots


def kernel_sum(windows: Sequence[Any], output_grad: Any) -> Any:
    """`sum_i g_i` of an ungrouped convolution's kernel, `(K, C, F)`."""
    d = _positions(output_grad)
    return ops.stack([ops.einsum("bpc,bpf->cf", _positions(w), d) for w in windows], axis=0)


def separable_gradients(
    windows: Sequence[Any], output_grad: Any, depthwise_kernel: Any, pointwise_kernel: Any
) -> tuple[Any, Any]:
    """Per-example gradients of a separable convolution's two kernels: a depthwise one
    `(K, C, M)` whose output `U_i` (P x C M) a pointwise one `(C M, F)` maps to the output.

    `U_i[p, c M + m] = sum_k S_ik[p, c] W[k, c, m]`; the pointwise kernel's gradient is
    `U_i^T D_i`, the depthwise one's that of a depthwise convolution whose output
    gradient is `D_i V^T` (V the pointwise kernel).

    Returns:
        `(B, K, C, M)` and `(B, C M, F)`.
    """
    d = f32(output_grad)
    batch = d.shape[0]
    depthwise, pointwise = f32(depthwise_kernel), f32(pointwise_kernel)
    intermediate = 0.0
    for k, window in enumerate(windows):
        intermediate = intermediate + f32(window)[..., None] * depthwise[k]
    intermediate = ops.reshape(intermediate, (batch, -1, depthwise.shape[1] * depthwise.shape[2]))
    pointwise_grads = ops.einsum("bpc,bpf->bcf", intermediate, _positions(d))
    intermediate_grad = ops.matmul(d, ops.transpose(pointwise))  # (B, *spatial, C M)
    channels = depthwise.shape[1]
    depthwise_grads = kernel_gradients(windows, intermediate_grad, groups=channels)
    return ops.reshape(depthwise_grads, (batch, *depthwise.shape)), pointwise_grads


def position_sums(output_grad: Any) -> Any:
    """`(B, F)`: example i's gradient of a bias added at every position, `sum_p D_i[p]`."""
    d = f32(output_grad)
    return ops.sum(d, axis=tuple(range(1, len(d.shape) - 1)))


def total(terms: Sequence[Any]) -> Any:
    """The sum of one or more tensors of one shape (what `tf.add_n` gives, on any backend)."""
    return functools.reduce(ops.add, terms)


def prelu_gradients(inputs: Any, output_grad: Any, shared_axes: Sequence[int]) -> Any:
    """PReLU (`y = max(x, 0) + alpha * min(x, 0)`): example i's gradient of `alpha`,
    `d_i * min(x_i, 0)`, summed along the `shared_axes` (kept, as `alpha` keeps them)."""
    grad = f32(output_grad) * ops.minimum(f32(inputs), 0.0)
    shared = sorted(shared_axes or [])
    return ops.sum(grad, axis=shared, keepdims=True) if shared else grad


def layer_scale_gradients(inputs: Any, output_grad: Any) -> Any:
    """ConvNeXt's LayerScale (`y = x * gamma`, `gamma` along the last axis): example i's
    gradient of `gamma`, `sum_pos x_i * d_i`."""
    products = f32(inputs) * f32(output_grad)
    return ops.sum(products, axis=tuple(range(1, len(products.shape) - 1)))


# -- normalizations -----------------------------------------------------------
#
# LayerNormalization, RMSNormalization and GroupNormalization compute
# `y = n(x) * scale + offset`, `n(x)` normalized within one example; example i's
# parameter gradients are `sum d_i n(x_i)` and `sum d_i` over the axes the parameters
# do not span. What the engines share: which layers a rule covers, `n(x)` as each
# layer computes it, and the reductions.


def built_input_rank(layer: Any) -> int | None:
    """The rank of the input the layer was built for, if Keras recorded it."""
    shape = (layer.get_build_config() or {}).get("input_shape")
    return len(shape) if isinstance(shape, (list, tuple)) else None


def axes_list(axis: int | Sequence[int]) -> list[int]:
    return [axis] if isinstance(axis, int) else list(axis)


def excludes_batch_axis(layer: Any, axis: int | Sequence[int]) -> bool:
    """False when `axis` is (or may be) the batch axis of the layer's input."""
    rank = built_input_rank(layer)
    if rank is None:
        return all(a != 0 for a in axes_list(axis))
    return all(a % rank != 0 for a in axes_list(axis))


def spans_trailing_axes(layer: Any) -> bool:
    """Whether the layer's `axis` is its input's trailing axes: `ops.rms_normalization`
    broadcasts `scale` against those, whatever `axis` says, so only then is a rule's view
    (the scale spans `axis`) RMSNormalization's."""
    axes, rank = axes_list(layer.axis), built_input_rank(layer)
    if rank is None:
        # Without the rank, only negative axes can be known to be trailing.
        return sorted(axes) == list(range(-len(axes), 0))
    resolved = sorted(a % rank for a in axes)
    return 0 not in resolved and resolved == list(range(rank - len(resolved), rank))


def uses_batch_statistics(layer: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call of BatchNormalization's `call(inputs, training=None, mask=None)`
    normalizes with the batch's moments: Keras' condition, `training and self.trainable`
    (the one call that mixes examples: both engines couple the layers before it)."""
    training = args[1] if len(args) > 1 else kwargs.get("training")
    return bool(training) and bool(layer.trainable)


def epsilon_of(layer: Any) -> float:
    return keras.config.epsilon() if layer.epsilon is None else layer.epsilon


def layer_normalized(layer: Any, x: Any, axes: Sequence[int]) -> Any:
    """LayerNormalization's `n(x)` over `axes` (its deprecated `rms_scaling` divides by
    the standard deviation)."""
    if layer.rms_scaling:
        return variance_scaled(x, axes, epsilon_of(layer))
    return centered_normalized(x, axes, epsilon_of(layer))


def rms_normalized(layer: Any, x: Any, axes: Sequence[int]) -> Any:
    """RMSNormalization's `n(x)` over `axes`."""
    return rms_scaled(x, axes, epsilon_of(layer))


def centered_normalized(x: Any, axes: Sequence[int], epsilon: float) -> Any:
    """`(x - mean) / sqrt(variance + epsilon)` over `axes` of each example, as
    `keras.ops.layer_normalization` computes it."""
    x = f32(x)
    mean, variance = ops.moments(x, axes=list(axes), keepdims=True)
    inverse = ops.rsqrt(variance + epsilon)
    return x * inverse - mean * inverse


def variance_scaled(x: Any, axes: Sequence[int], epsilon: float) -> Any:
    """`x / sqrt(variance + epsilon)` over `axes` (LayerNormalization's `rms_scaling`)."""
    x = f32(x)
    return x * ops.rsqrt(ops.var(x, axis=list(axes), keepdims=True) + epsilon)


def rms_scaled(x: Any, axes: Sequence[int], epsilon: float) -> Any:
    """`x / sqrt(mean(x^2) + epsilon)` over `axes` (`keras.ops.rms_normalization`)."""
    x = f32(x)
    return x * ops.rsqrt(ops.mean(ops.square(x), axis=list(axes), keepdims=True) + epsilon)


def in_groups(x: Any, channel_axis: int, groups: int) -> Any:
    """`x` laid out `(B, ..., groups, C / groups, ...)`, the groups at `channel_axis`
    (GroupNormalization's view; its non-batch sizes static)."""
    shape = list(x.shape)
    axis = channel_axis % len(shape)
    return ops.reshape(x, [-1, *shape[1:axis], groups, shape[axis] // groups, *shape[axis + 1 :]])


def group_moments(grouped: Any, channel_axis: int, epsilon: float) -> tuple[Any, Any]:
    """GroupNormalization's `(mean, inverse)` per example and group, from the input laid
    out in groups (`in_groups`), each spread to one value per channel at the input's
    rank: `(B, 1.., C, 1..)`, so that `n(x) = (x - mean) * inverse`."""
    rank = len(grouped.shape) - 1
    axis = channel_axis % rank
    reduction = [a for a in range(1, rank + 1) if a != axis]
    mean, variance = ops.moments(grouped, axes=reduction, keepdims=True)
    inverse = ops.rsqrt(variance + epsilon)
    # (B, 1.., groups, 1, 1..) to (B, 1.., groups, C / groups, 1..) to (B, 1.., C, 1..).
    spread = [1] * (rank + 1)
    spread[axis : axis + 2] = grouped.shape[axis : axis + 2]
    by_channel = [-1] + [1] * (rank - 1)
    by_channel[axis] = grouped.shape[axis] * grouped.shape[axis + 1]

    def to_channels(moment: Any) -> Any:
        spread_out = ops.broadcast_to(moment, [ops.shape(moment)[0], *spread[1:]])
        return ops.reshape(spread_out, by_channel)

    return to_channels(mean), to_channels(inverse)


def affine_per_example(output_grad: Any, normalized: Any | None, kept_axes: Sequence[int]) -> Any:
    """Example i's gradient of a parameter of `y = n(x) * scale + offset` spanning the
    input's `kept_axes`: `sum d_i * n(x_i)` (the scale; `normalized` is `n(x)`) or
    `sum d_i` (the offset; `normalized=None`) over the other non-batch axes.

    Returns:
        `(B, *[x.shape[a] for a in kept_axes])`.
    """
    d = f32(output_grad)
    term = d if normalized is None else d * f32(normalized)
    summed = [a for a in range(1, len(d.shape)) if a not in set(kept_axes)]
    return ops.sum(term, axis=summed) if summed else term


def scale_from_moments(
    x: Any, output_grad: Any, mean: Any | None, inverse: Any, kept_axes: Sequence[int]
) -> Any:
    """`sum d_i (x_i - mean) inverse` (mean None: `sum d_i x_i inverse`) over the
    non-batch axes not in `kept_axes`, for a mean and inverse constant over those axes
    (GroupNormalization's, BatchNormalization's): `inverse (sum d_i x_i - mean sum d_i)`,
    two sums per kept position and no `n(x)` as large as the input (Keras' own
    gradient of gamma takes the same order).

    Returns:
        `(B, *[x.shape[a] for a in kept_axes])`.
    """
    x, d = f32(x), f32(output_grad)
    summed = [a for a in range(1, len(d.shape)) if a not in set(kept_axes)]
    sum_dx = ops.sum(d * x, axis=summed, keepdims=True)
    if mean is not None:
        sum_dx = sum_dx - mean * ops.sum(d, axis=summed, keepdims=True)
    gradient = inverse * sum_dx
    # (Squeezing no axes would squeeze every axis of size one.)
    return ops.squeeze(gradient, axis=summed) if summed else gradient


# -- LoRA -----------------------------------------------------------------------
#
# With LoRA (`layer.enable_lora(rank, lora_alpha)`) Dense, EinsumDense and Embedding
# use the kernel `W + s a b`, `s = lora_alpha / rank`, `a` the kernel's shape with its
# last axis replaced by the rank, `b` `(rank, last axis)`; `W` is frozen. The layer is
# two EinsumDense stages in a row, and each factor's per-example gradient is an
# EinsumDense kernel gradient of its stage: never one of the full kernel's size.


@dataclasses.dataclass(frozen=True)
class LoraStage:
    """One LoRA factor's per-example gradient, `einsum_kernel_gradients(roles, inputs,
    output_grad)`: its stage's input and output gradient (float32, the scale `s` in them).

    Attributes:
        factor: `"a"` or `"b"`.
        roles: The stage's equation, by role, its kernel the factor.
        inputs: The stage's input, laid out as `roles.input` says.
        output_grad: The gradient at the stage's output, as `roles.output` says.
    """

    factor: str
    roles: EinsumRoles
    inputs: Any
    output_grad: Any


# The trainable variables a layer with LoRA may have for the rules to cover it.
LORA_VARIABLES = frozenset(
    {"lora_kernel_a", "lora_kernel_b", "lora_embeddings_a", "lora_embeddings_b", "bias"}
)


def lora_covered(layer: Any) -> bool:
    """Whether the LoRA rules cover the layer: LoRA enabled, not quantized, the kernel
    (or table) frozen as `enable_lora` leaves it; an EinsumDense's equation with a
    batch letter first (`einsum_roles`)."""
    if not getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return False
    if any(v.name not in LORA_VARIABLES for v in layer.trainable_variables):
        return False
    if hasattr(layer, "equation"):
        input_rank = layer.input_spec.ndim if layer.input_spec is not None else None
        return einsum_roles(layer.equation, input_rank) is not None
    return True


def lora_scale(layer: Any) -> float:
    """`s = lora_alpha / lora_rank`, as the layer scales `a b`."""
    return layer.lora_alpha / layer.lora_rank


def lora_einsum_stages(
    roles: EinsumRoles, x: Any, d: Any, lora_a: Any, lora_b: Any, scale: float
) -> tuple[LoraStage, LoraStage]:
    """The two stages of an EinsumDense with LoRA, for its input `x` and output gradient
    `d` (as `roles` lays them out) and the factors' values.

    With `L` the kernel's last letter and `r` the rank's: where `L` is in the output,
    `u = x a` (the output with `r` for `L`, or beside a shared `L`) and `z = s u b`:
    `g(a) = einsum(x, s d b^T)`, `g(b) = einsum(s u, d)`. Where `L` is contracted,
    `v = einsum(x, b)` (the input with `r` for `L`) and `z = s v a`:
    `g(b) = einsum(x, s d a^T)`, `g(a) = einsum(s v, d)`.

    Example:

    ```python
    # "btd,dnh->btnh": u = "btd,dnr->btnr", z = "btnr,rh->btnh"
    stage_a, stage_b = lora_einsum_stages(roles, x, d, a, b, 0.5)
    grads_a = einsum_kernel_gradients(stage_a.roles, stage_a.inputs, stage_a.output_grad)
    ```
    """
    x, d, lora_a, lora_b = f32(x), f32(d), f32(lora_a), f32(lora_b)
    equation = f"{roles.input},{roles.kernel}->{roles.output}"
    rank = next(c for c in string.ascii_letters if c not in equation)
    last = roles.kernel[-1]
    a_spec, b_spec = roles.kernel[:-1] + rank, rank + last
    if last in roles.output:  # x a first
        if last in roles.input:
            middle = roles.output + rank
        else:
            middle = roles.output.replace(last, rank)
        first, second, first_spec, second_spec = "a", "b", a_spec, b_spec
        first_value, second_value = lora_a, lora_b
    else:  # x b first
        middle = "".join(c for c in roles.input.replace(last, rank) if c in roles.output + a_spec)
        first, second, first_spec, second_spec = "b", "a", b_spec, a_spec
        first_value, second_value = lora_b, lora_a
    first_roles = einsum_roles(f"{roles.input},{first_spec}->{middle}", None)
    second_roles = einsum_roles(f"{middle},{second_spec}->{roles.output}", None)
    assert first_roles is not None and second_roles is not None
    middle_value = ops.einsum(f"{roles.input},{first_spec}->{middle}", x, first_value) * scale
    middle_grad = ops.einsum(f"{roles.output},{second_spec}->{middle}", d, second_value) * scale
    return (
        LoraStage(first, first_roles, x, middle_grad),
        LoraStage(second, second_roles, middle_value, d),
    )


def lora_dense_stages(
    x: Any, d: Any, lora_a: Any, lora_b: Any, scale: float
) -> tuple[LoraStage, LoraStage]:
    """The stages of a Dense layer with LoRA (`lora_einsum_stages` of `...i,io->...o`):
    `g_i(a) = A_i^T (s D_i b^T)`, `g_i(b) = (s A_i a)^T D_i`, for `x` (B, ..., in)."""
    roles = einsum_roles("...i,io->...o", len(x.shape))
    assert roles is not None
    return lora_einsum_stages(roles, x, d, lora_a, lora_b, scale)


def lora_embedding_operands(
    ids: Any, d: Any, lora_a: Any, lora_b: Any, scale: float
) -> tuple[Any, Any]:
    """An Embedding with LoRA, for its (wrapped) ids `(B, T)` and output gradient
    `(B, T, dim)`: `(s D b^T, s a[ids])`. `g_i(a)` is an Embedding gradient (rows
    `s d_t b^T` added at the ids: `token_gram_sq_norms`, `token_dots`); `g_i(b) =
    (s a[ids_i])^T D_i` a Dense one (`dense_kernel_gradients`)."""
    d = f32(d)
    projected_grad = ops.matmul(d, ops.transpose(f32(lora_b))) * scale
    looked_up = ops.take(f32(lora_a), ids, axis=0) * scale
    return projected_grad, looked_up
