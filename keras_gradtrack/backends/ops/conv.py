"""Rules over `keras.ops` for Conv1D/2D/3D, their transposes, DepthwiseConv1D/2D and SeparableConv1D/2D.

The math is `keras_gradtrack.rule_math`; what is this module's own is cutting the
layer's input into windows: for each kernel offset k, a strided slice of the
padded input with the layer's strides and dilation (on JAX one `lax.slice`) gives `S_ik`, example i's
input under offset k at each output position (`(B, *spatial, C)`, channels last). No
patches tensor of `K^2` cost (as `lax.conv_general_dilated_patches` builds), no
vmap: example i's kernel gradient is `S_ik^T D_i` per offset and group.

Example:

```python
windows = input_windows(layer, x, output_spatial)     # K tensors (B, *spatial, C)
```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

from keras_gradtrack import rule_math
from keras_gradtrack.backends.ops.rules import (
    LayerPrimitives,
    ProbedCall,
    ProbedRule,
    plain_weights,
)
from keras_gradtrack.rule_math import f32


def channels_last(layer: Any, tensor: Any) -> Any:
    if getattr(layer, "data_format", "channels_last") == "channels_first":
        return ops.moveaxis(tensor, 1, -1)
    return tensor


def input_windows(layer: Any, x: Any, output_spatial: Sequence[int]) -> list[Any]:
    """One `(B, *output_spatial, C)` window of the channels-last input per kernel offset
    (row-major over the kernel's spatial axes, as the kernel lays them out), padded as
    the layer pads."""
    x = f32(x)
    spatial = x.shape[1:-1]
    kernel_size, strides, dilation = layer.kernel_size, layer.strides, layer.dilation_rate
    if layer.padding == "causal":
        pads = [(dilation[0] * (kernel_size[0] - 1), 0)]
    elif layer.padding == "same":
        # What a "valid" window at every output position needs, the extra after (for a
        # convolution, lax's SAME; for a transposed one, at the input's positions).
        pads = []
        for size, out, k, s, r in zip(spatial, output_spatial, kernel_size, strides, dilation):
            total = max((out - 1) * s + (k - 1) * r + 1 - size, 0)
            pads.append((total // 2, total - total // 2))
    else:
        pads = [(0, 0)] * len(spatial)
    x = ops.pad(x, [(0, 0), *pads, (0, 0)])
    windows = []
    for offset in itertools.product(*(range(k) for k in kernel_size)):
        start = [o * r for o, r in zip(offset, dilation)]
        limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, output_spatial, strides)]
        spans = tuple(slice(b, e, s) for b, e, s in zip(start, limit, strides))
        windows.append(x[(slice(None), *spans, slice(None))])
    return windows


def _by_name(layer: Any, values: Sequence[Any], others: Sequence[Any]) -> dict[str, Any]:
    pairs = [*zip(layer.trainable_variables, values), *zip(layer.non_trainable_variables, others)]
    return {variable.name: value for variable, value in pairs}


def _trainable_names(layer: Any) -> set[str]:
    return {variable.name for variable in layer.trainable_variables}


def _windows_and_grads(layer: Any, call: ProbedCall) -> tuple[list[Any], Any]:
    """The windows `(B, *spatial, C)` and output gradients `(B, *spatial, F)`, channels
    last."""
    x = channels_last(layer, call.inputs)
    d = f32(channels_last(layer, call.output_grad))
    return input_windows(layer, x, d.shape[1:-1]), d


def conv_per_example(
    layer: Any,
    values: Sequence[Any],
    call: ProbedCall,
    others: Sequence[Any] = (),
    kernel_gradients: Callable[[Sequence[Any], Any, int], Any] = rule_math.kernel_gradients,
) -> list[Any]:
    """Conv1D/2D/3D and DepthwiseConv1D/2D: example i's kernel gradient `S_ik^T D_i` per
    offset and group (a depthwise kernel `(..., C, M)` is the grouped case with C
    groups), the bias's `sum_p D_i[p]`. `kernel_gradients`: the form of
    `rule_math.kernel_gradients` to use (a backend's kernel of the same math)."""
    trainable = _trainable_names(layer)
    windows, d = _windows_and_grads(layer, call)
    batch = d.shape[0]
    grads = {}
    if "kernel" in trainable:
        kernel_shape = tuple(_by_name(layer, values, others)["kernel"].shape)
        if getattr(layer, "depth_multiplier", None) is not None:
            groups = kernel_shape[-2]  # depthwise: one group per input channel
        else:
            groups = layer.groups
        kernel = kernel_gradients(windows, d, groups)
        grads["kernel"] = ops.reshape(kernel, (batch, *kernel_shape))
    if "bias" in trainable:
        grads["bias"] = rule_math.position_sums(d)
    return [grads[v.name] for v in layer.trainable_variables]


def conv_primitives(
    layer: Any, call: ProbedCall, refs: Sequence[Any] | None
) -> LayerPrimitives | None:
    """Conv1D/2D/3D without groups, where the Gram form is cheaper than materializing
    (`rule_math.gram_is_cheaper`): `||g_i||^2` from the windows' and the output
    gradients' Gram matrices over positions, `<g_i, R> = sum_k <S_ik R_k, D_i>`.
    None elsewhere (the engine then takes them from `conv_per_example`). With
    `refs=None` (norm-only) it returns `dot=None` and forms no product with a reference."""
    if refs is not None and len(refs) != len(layer.trainable_variables):
        return None
    names = [v.name for v in layer.trainable_variables]
    if layer.groups != 1 or "kernel" not in names:
        return None
    *window_shape, channels, filters = layer.kernel.shape
    shape = call.output_grad.shape
    positions = math.prod(shape[2:] if layer.data_format == "channels_first" else shape[1:-1])
    width_in = math.prod(window_shape) * channels
    if not rule_math.gram_is_cheaper(positions, width_in, filters, dots=refs is not None):
        return None
    windows, d = _windows_and_grads(layer, call)
    sq_norm = rule_math.kernel_gram_sq_norms(windows, d)
    sum_sq_norm = None  # with a reference factor, the step's ||G||^2 / c^2
    if call.reference_factor is None:
        sum_sq_norm = ops.sum(rule_math.kernel_sum(windows, d) ** 2)
    dot = None
    if refs is not None:
        kernel_ref = ops.reshape(f32(refs[names.index("kernel")]), (-1, channels, filters))
        dot = rule_math.kernel_dots(windows, d, kernel_ref)
    if "bias" in names:
        bias_grad = rule_math.position_sums(d)
        sq_norm = sq_norm + ops.sum(bias_grad**2, axis=1)
        if sum_sq_norm is not None:
            sum_sq_norm = sum_sq_norm + ops.sum(ops.sum(bias_grad, axis=0) ** 2)
        if refs is not None:
            dot = dot + ops.matmul(bias_grad, f32(refs[names.index("bias")]))
    return LayerPrimitives(sq_norm, dot, sum_sq_norm)


def separable_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """SeparableConv1D/2D: `rule_math.separable_gradients` of the windows, both kernels'
    values and the output gradients; the bias's `sum_p D_i[p]`."""
    trainable = _trainable_names(layer)
    windows, d = _windows_and_grads(layer, call)
    batch = d.shape[0]
    variables = _by_name(layer, values, others)
    depthwise, pointwise = variables["depthwise_kernel"], variables["pointwise_kernel"]
    depthwise_grads, pointwise_grads = rule_math.separable_gradients(
        windows,
        d,
        ops.reshape(f32(depthwise), (-1, *depthwise.shape[-2:])),
        ops.reshape(f32(pointwise), tuple(pointwise.shape[-2:])),
    )
    grads = {
        "depthwise_kernel": ops.reshape(depthwise_grads, (batch, *depthwise.shape)),
        "pointwise_kernel": ops.reshape(pointwise_grads, (batch, *pointwise.shape)),
    }
    if "bias" in trainable:
        grads["bias"] = rule_math.position_sums(d)
    return [grads[v.name] for v in layer.trainable_variables]


def conv_transpose_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """Conv1D/2D/3DTranspose, the adjoint of the convolution with its kernel
    (`*kernel_size, filters, C_in`) from its output space to its input's: example i's
    kernel gradient is that convolution's filter gradient with the roles swapped, the
    windows sliding over the output gradient `D_i` at the input's positions,
    `g_i[k] = S_k(D_i)^T x_i`; the bias's `sum_p D_i[p]`."""
    trainable = _trainable_names(layer)
    x = f32(channels_last(layer, call.inputs))
    d = f32(channels_last(layer, call.output_grad))
    batch = d.shape[0]
    grads = {}
    if "kernel" in trainable:
        kernel_shape = tuple(_by_name(layer, values, others)["kernel"].shape)
        windows = input_windows(layer, d, x.shape[1:-1])
        kernel = rule_math.kernel_gradients(windows, x)
        grads["kernel"] = ops.reshape(kernel, (batch, *kernel_shape))
    if "bias" in trainable:
        grads["bias"] = rule_math.position_sums(d)
    return [grads[v.name] for v in layer.trainable_variables]


def conv_transpose_applies(layer: Any) -> bool:
    """As the TensorFlow rule: plain weights, not dilated."""
    return plain_weights(layer) and all(rate == 1 for rate in layer.dilation_rate)


CONV = ProbedRule(
    "conv", conv_per_example, conv_primitives, applies=plain_weights, sums_batch_gradient=True
)
DEPTHWISE_CONV = ProbedRule(
    "depthwise_conv", conv_per_example, applies=plain_weights, sums_batch_gradient=True
)
SEPARABLE_CONV = ProbedRule(
    "separable_conv", separable_per_example, applies=plain_weights, sums_batch_gradient=True
)
CONV_TRANSPOSE = ProbedRule(
    "conv_transpose",
    conv_transpose_per_example,
    applies=conv_transpose_applies,
    sums_batch_gradient=True,
)
