"""Rule for Conv1DTranspose, Conv2DTranspose and Conv3DTranspose.

A transposed convolution with kernel `W` (`*kernel_size, filters, C_in`) is the
adjoint of the convolution `conv(., W)` from its output space to its input
space (same strides, padding and dilation): `<conv_transpose(x, W), d> =
<x, conv(d, W)>`. Example i's kernel gradient is therefore that convolution's
filter gradient with the roles swapped: the windows slide over the output
gradient `D_i` at the positions of the input `x_i`, `g_i[k] = S_k(D_i)^T x_i`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack.rule_math import gram_is_cheaper
from keras_gradtrack.rules import windows
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference
from keras_gradtrack.rules.filter_gradients import (
    convolution_rule,
    kernel_and_bias_per_example,
)
from keras_gradtrack.rules.ops import has_plain_weights, positions_per_example


def conv_transpose_applies(layer: Any) -> bool:
    """As for convolutions, but not dilated: TensorFlow runs those on CPU only under
    XLA, so the rule has no oracle check for them (the fallback is exact)."""
    return has_plain_weights(layer) and all(rate == 1 for rate in layer.dilation_rate)


def conv_transpose_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for Conv1D/2D/3DTranspose.

    Example:

    ```python
    # windows S_ik of D_i (P_in, filters) at the input's P_in positions, x_i (P_in, C_in):
    # g_i[k] = S_ik^T x_i,  ||g_i||^2 = sum_k ||S_ik^T x_i||^2 or <sum_k S_ik S_ik^T, x_i x_i^T>
    ```
    """
    pairs = windows.channels_last_pairs(layer, calls, swapped=True)
    return windows.kernel_and_bias_primitives(
        layer, calls, reference, pairs, 1, layer.kernel.shape[-2:]
    )


def conv_transpose_dot(layer: Any, calls: Sequence[LayerCall], reference: Reference) -> Any:
    """`(B,)` `<g_i, R>` without per-example gradients: the layer's transposed
    convolution of its inputs with R's kernel, paired with the output gradients,
    plus the bias term."""

    def convolved(inputs: Any, kernel: Any) -> Any:
        options = windows.convolution_options(layer, output_padding=layer.output_padding)
        return ops.conv_transpose(inputs, kernel, **options)

    return windows.forward_dot(layer, calls, reference, convolved)


def conv_transpose_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """Whether per-example kernel gradients cost less than the direct form."""
    if not layer.kernel.trainable:
        return True
    filters, channels = layer.kernel.shape[-2:]
    window_width = math.prod(layer.kernel_size) * filters
    inputs = [call.inputs for call in calls]
    positions = positions_per_example(inputs, layer.data_format == "channels_first")
    return not gram_is_cheaper(positions, window_width, channels, dots=True)


def conv_transpose_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of a transposed convolution's kernel and bias."""
    return kernel_and_bias_per_example(
        layer, calls, windows.channels_last_pairs(layer, calls, swapped=True), 1
    )


CONV_TRANSPOSE = convolution_rule(
    "conv_transpose",
    (
        conv_transpose_primitives,
        conv_transpose_per_example,
        conv_transpose_materializes,
        conv_transpose_dot,
    ),
    conv_transpose_applies,
    # The windows slide over the output gradient (the kernel's `filters` axis).
    lambda layer: (1, layer.kernel.shape[-2]),
)
