"""The per-example math of the convolution and normalization rules, in `keras.ops` only.

Nothing here imports TensorFlow or JAX: an engine brings what is its own (how it
records a layer's inputs and output gradients, how it cuts a convolution's input
into windows) and calls these functions for the math, which any Keras backend
runs. All inputs are cast to float32; every result is float32.

Notation: `B` examples, `P` output positions per example, `C` input channels,
`F` output channels (filters), `K` kernel offsets (the product of the kernel size).

Example:

```python
windows = [x_window(offset) for offset in kernel_offsets]   # K tensors (B, *spatial, C)
grads = kernel_gradients(windows, d, groups=1)              # (B, K, C, F)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops

# Materializing per-example gradients of at most this many values per example is
# weighed against the Gram form; larger ones are materialized only where the Gram
# form costs more (both engines' cost model: the TensorFlow engine's `rules/cost.py`
# reads these two).
MATERIALIZE_MAX_VALUES = 2**16
# One pass over a tensor, in multiply-adds of a matrix product of the same time (a
# CPU calibration, docs/performance.md), times the passes a materialized gradient
# takes (sum, norm, dot).
MATERIALIZED_PASS_COST = 16


def f32(value: Any) -> Any:
    return ops.cast(value, "float32")


def gram_is_cheaper(positions: int, width_in: int, width_out: int, dots: bool) -> bool:
    """Whether `||X_i^T D_i||^2` costs less as `<X_i X_i^T, D_i D_i^T>` than by
    materializing `X_i^T D_i`, for `X_i` (P x in) and `D_i` (P x out).

    The Gram form costs `P^2 (in + out)` per example, plus `P in out` for the dot
    with a reference (`dots`); materializing costs `P in out`, then a few passes over
    its `in out` values, and holds `B in out` of them.
    """
    values = width_in * width_out
    if positions * (width_in + width_out) >= values:
        return False
    gram = positions**2 * (width_in + width_out) + (positions * values if dots else 0)
    return values > MATERIALIZE_MAX_VALUES or gram < MATERIALIZED_PASS_COST * values


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
    d = _positions(output_grad)
    stacked = ops.concatenate([_positions(w) for w in windows], axis=-1)  # (B, P, K C)
    window_gram = ops.einsum("bpc,bqc->bpq", stacked, stacked)
    grad_gram = ops.einsum("bpf,bqf->bpq", d, d)
    return ops.sum(window_gram * grad_gram, axis=(1, 2))


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


# -- normalizations -----------------------------------------------------------


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


def group_normalized(x: Any, channel_axis: int, groups: int, epsilon: float) -> Any:
    """`x` normalized over every non-batch axis within each of `groups` groups of
    channels along `channel_axis` (GroupNormalization's `n(x)`)."""
    x = f32(x)
    shape = list(x.shape)
    axis = channel_axis % len(shape)
    grouped_shape = [-1, *shape[1:axis], groups, shape[axis] // groups, *shape[axis + 1 :]]
    grouped = ops.reshape(x, grouped_shape)
    reduced = [a for a in range(1, len(grouped_shape)) if a != axis]
    mean, variance = ops.moments(grouped, axes=reduced, keepdims=True)
    inverse = ops.rsqrt(variance + epsilon)
    return ops.reshape(grouped * inverse - mean * inverse, (-1, *shape[1:]))


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
