"""Rule for SeparableConv1D and SeparableConv2D.

A separable convolution is a depthwise convolution (kernel `W_d`, `(*kernel_size,
C, M)`) followed by a pointwise one (kernel `W_p`, `(1, ..., C * M, filters)`)
and the bias. The tap gives `D_i`, the gradient at the pre-activation output,
so the pointwise kernel's per-example gradient is `U_i^T D_i` with `U_i` the
depthwise output, which the rule recomputes from the input's windows; the
gradient at `U_i` is `D_i W_p^T`, from which the depthwise rule gives the
depthwise kernel's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule
from keras_gradtrack.rules.cost import gram_is_cheaper
from keras_gradtrack.rules.ops import has_plain_weights, sequence_kernel_sq_norm
from keras_gradtrack.rules.windows import (
    grouped_kernel_primitives,
    grouped_response,
    input_windows,
    output_positions,
    per_example_bias_gradient,
    per_example_kernel_gradients,
    with_bias,
)


def depthwise_output(layer: Any, slices: Sequence[tf.Tensor]) -> tf.Tensor:
    """`U_i`, `(B, P, C * M)`: the depthwise convolution of the input, without bias."""
    kernel = tf.cast(layer.depthwise_kernel.value, tf.float32)
    flat_kernel = tf.reshape(kernel, [len(slices), 1, -1])
    return grouped_response(slices, flat_kernel, groups=kernel.shape[-2])


def depthwise_output_grads(layer: Any, targets: tf.Tensor) -> tf.Tensor:
    """`D_i W_p^T`, `(B, P, C * M)`: the gradient at the depthwise output."""
    pointwise = layer.pointwise_kernel
    kernel = tf.reshape(tf.cast(pointwise.value, tf.float32), pointwise.shape[-2:])
    return tf.einsum("bpf,cf->bpc", targets, kernel)


def separable_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for SeparableConv1D/2D.

    Example:

    ```python
    # U_i = depthwise(x_i) (P, C * M), D_i (P, filters):
    # g_i[pointwise] = U_i^T D_i,  g_i[depthwise] = the depthwise rule's with D_i W_p^T
    ```
    """
    slices, targets = input_windows(layer, calls)
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    terms = []
    if pointwise.trainable:
        intermediate = depthwise_output(layer, slices)
        pointwise_reference = tf.reshape(reference(pointwise), pointwise.shape[-2:])
        response = tf.einsum("bpc,cf->bpf", intermediate, pointwise_reference)
        terms.append(
            LayerPrimitives(
                sq_norm=sequence_kernel_sq_norm(intermediate, targets),
                dot=tf.reduce_sum(response * targets, axis=[1, 2]),
            )
        )
    if depthwise.trainable:
        depthwise_reference = tf.reshape(reference(depthwise), [len(slices), 1, -1])
        terms.append(
            grouped_kernel_primitives(
                slices,
                depthwise_output_grads(layer, targets),
                depthwise.shape[-2],
                depthwise_reference,
            )
        )
    return with_bias(layer, calls, reference, terms)


def separable_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """Whether both kernels' per-example gradients cost less than their Gram forms."""
    positions = output_positions(layer, calls)
    channels, multiplier = layer.depthwise_kernel.shape[-2:]
    filters = layer.pointwise_kernel.shape[-1]
    window_width = math.prod(layer.kernel_size)
    return not (
        gram_is_cheaper(positions, window_width, multiplier)
        or gram_is_cheaper(positions, channels * multiplier, filters)
    )


def separable_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, tf.Tensor]]:
    """Per-example gradients of a SeparableConv1D/2D layer's kernels and bias."""
    slices, targets = input_windows(layer, calls)
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    pairs = []
    if depthwise.trainable:
        grads = depthwise_output_grads(layer, targets)
        pairs.append((depthwise, per_example_kernel_gradients(slices, grads, depthwise.shape[-2])))
    if pointwise.trainable:
        per_pointwise = tf.einsum("bpc,bpf->bcf", depthwise_output(layer, slices), targets)
        pairs.append((pointwise, per_pointwise))
    bias_grad = per_example_bias_gradient(layer, calls)
    if bias_grad is not None:
        pairs.append((layer.bias, bias_grad))
    return pairs


SEPARABLE_CONV = Rule(
    "separable_conv",
    separable_primitives,
    has_plain_weights,
    per_example=separable_per_example,
    materializes=separable_materializes,
)
