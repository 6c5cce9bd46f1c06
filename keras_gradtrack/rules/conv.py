"""Rules for Conv1D/2D/3D and DepthwiseConv1D/2D.

Example i's kernel gradient at offset k is `S_ik^T D_i` per group of channels
(see `keras_gradtrack.rules.windows`); a depthwise convolution is the grouped
one with one group per input channel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack._keras_seam import causal_padding
from keras_gradtrack.rule_math import gram_is_cheaper
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference
from keras_gradtrack.rules.filter_gradients import (
    convolution_rule,
    kernel_and_bias_per_example,
)
from keras_gradtrack.rules.ops import has_plain_weights, positions_per_example
from keras_gradtrack.rules.windows import (
    channels_last_pairs,
    convolution_options,
    forward_dot,
    kernel_and_bias_primitives,
)


def kernel_materializes(
    layer: Any, calls: Sequence[LayerCall], group_channels: int, group_filters: int, groups: int
) -> bool:
    """Whether per-example kernel gradients cost less than the direct form
    (`rule_math.gram_is_cheaper` says no, per group)."""
    if not layer.kernel.trainable:
        return True  # only the bias, (B, filters)
    tapped = [call.tapped[0] for call in calls]
    positions = positions_per_example(tapped, layer.data_format == "channels_first")
    window_width = math.prod(layer.kernel_size) * group_channels
    return not gram_is_cheaper(positions, window_width, group_filters, dots=True, groups=groups)


def conv_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for Conv1D/2D/3D.

    Example:

    ```python
    # windows S_ik (P, C / groups) per kernel offset k and group, D_i (P, filters):
    # g_i[k] = S_ik^T D_i,  ||g_i||^2 = sum_k ||S_ik^T D_i||^2 or <sum_k S_ik S_ik^T, D_i D_i^T>
    ```
    """
    return kernel_and_bias_primitives(
        layer,
        calls,
        reference,
        channels_last_pairs(layer, calls),
        layer.groups,
        [-1, layer.kernel.shape[-1]],
    )


def conv_dot(layer: Any, calls: Sequence[LayerCall], reference: Reference) -> Any:
    """`(B,)` `<g_i, R>` without per-example gradients: the layer's convolution of its
    inputs with R's kernel, paired with the output gradients, plus the bias term.

    Example:

    ```python
    # <g_i, R> = <conv(x_i, R_kernel), D_i> + <sum_p D_i[p], R_bias>
    ```
    """

    def convolved(inputs: Any, kernel: Any) -> Any:
        if layer.padding == "causal":  # as Conv1D's own call
            inputs = ops.pad(inputs, causal_padding(layer))
            return ops.conv(inputs, kernel, **convolution_options(layer, padding="valid"))
        return ops.conv(inputs, kernel, **convolution_options(layer))

    return forward_dot(layer, calls, reference, convolved)


def conv_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    # Kernel (*kernel_size, C / groups, filters).
    channels, filters = layer.kernel.shape[-2:]
    groups = layer.groups
    return kernel_materializes(layer, calls, channels, filters // groups, groups)


def conv_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of a Conv1D/2D/3D layer's kernel and bias."""
    return kernel_and_bias_per_example(
        layer, calls, channels_last_pairs(layer, calls), layer.groups
    )


def depthwise_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for DepthwiseConv1D/2D.

    A depthwise kernel `(*kernel_size, C, M)` is a grouped one of layout
    `(K, 1, C * M)` with C groups: output channel `c * M + m` sees input channel c only.

    Example:

    ```python
    # g_i[k, c, m] = sum_p S_ik[p, c] D_i[p, c * M + m]
    ```
    """
    return kernel_and_bias_primitives(
        layer, calls, reference, channels_last_pairs(layer, calls), layer.kernel.shape[-2], [1, -1]
    )


def depthwise_dot(layer: Any, calls: Sequence[LayerCall], reference: Reference) -> Any:
    """`(B,)` `<g_i, R>` without per-example gradients (see `conv_dot`)."""

    def convolved(inputs: Any, kernel: Any) -> Any:
        return ops.depthwise_conv(inputs, kernel, **convolution_options(layer))

    return forward_dot(layer, calls, reference, convolved)


def depthwise_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    # Kernel (*kernel_size, C, M): C groups of one channel, M filters each.
    channels, multiplier = layer.kernel.shape[-2:]
    return kernel_materializes(layer, calls, 1, multiplier, channels)


def depthwise_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of a DepthwiseConv1D/2D layer's kernel and bias."""
    channels = layer.kernel.shape[-2]
    return kernel_and_bias_per_example(layer, calls, channels_last_pairs(layer, calls), channels)


CONV = convolution_rule(
    "conv",
    (conv_primitives, conv_per_example, conv_materializes, conv_dot),
    has_plain_weights,
    lambda layer: (layer.groups, layer.kernel.shape[-2] * layer.groups),
)
DEPTHWISE_CONV = convolution_rule(
    "depthwise_conv",
    (depthwise_primitives, depthwise_per_example, depthwise_materializes, depthwise_dot),
    has_plain_weights,
    lambda layer: (layer.kernel.shape[-2], layer.kernel.shape[-2]),
)
