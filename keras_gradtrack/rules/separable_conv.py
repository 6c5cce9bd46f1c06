"""Rule for SeparableConv1D and SeparableConv2D.

A separable convolution is a depthwise convolution (kernel `W_d`, `(*kernel_size,
C, M)`) giving `U_i`, followed by a pointwise one (kernel `W_p`, `(1, ..., C * M,
filters)`) and the bias. The rule's tap runs the two convolutions apart (as
TensorFlow does inside `separable_conv2d`) and records `U_i` with the
pre-activation output, so the backward pass delivers both `D_i` and the gradient
at `U_i`, `D_i W_p^T`, at no extra cost. The pointwise kernel's per-example
gradient is then `U_i^T D_i`, and the depthwise rule's, fed `D_i W_p^T`, gives
the depthwise kernel's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from keras import ops

from keras_gradtrack.rule_math import gram_is_cheaper
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference, Rule, Tapped
from keras_gradtrack.rules.filter_gradients import (
    filter_gradient_kernel,
    per_example_filter_gradients,
)
from keras_gradtrack.rules.ops import (
    along_time,
    has_plain_weights,
    positions_per_example,
    reshape_per_example,
    sequence_kernel_sq_norm,
)
from keras_gradtrack.rules.windows import (
    Window,
    channels_last,
    convolution_options,
    grouped_kernel_primitives,
    paired,
    per_example_bias_gradient,
    stacked_windows,
    with_bias,
    with_bias_dot,
)


def separable_tap(
    layer: Any, call: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Tapped:
    """The layer's call as its two convolutions, tapping the pre-activation output and
    the depthwise output `U_i` (`tapped = (z, U)`, U channels last: CPU TensorFlow has
    no channels-first gradient for the pointwise convolution alone)."""
    inputs = args[0] if args else kwargs["inputs"]
    channels_first = layer.data_format == "channels_first"
    if channels_first:
        inputs = ops.moveaxis(inputs, 1, -1)
    depthwise = ops.depthwise_conv(
        inputs,
        layer.depthwise_kernel,
        strides=layer.strides,
        padding=layer.padding,
        data_format="channels_last",
        dilation_rate=layer.dilation_rate,
    )
    outputs = ops.conv(depthwise, layer.pointwise_kernel, data_format="channels_last")
    if layer.use_bias:
        outputs = ops.add(outputs, layer.bias)
    if channels_first:
        outputs = ops.moveaxis(outputs, -1, 1)
    preactivation = outputs
    if layer.activation is not None:
        outputs = layer.activation(outputs)
    return Tapped(outputs, (preactivation, depthwise))


def sequences(layer: Any, calls: Sequence[LayerCall]) -> tuple[Any, Any]:
    """`U` `(B, P, C * M)` and `D` `(B, P, filters)`, every call's positions stacked."""

    def positions(call: LayerCall) -> tuple[Any, Any]:
        u = ops.cast(call.tapped[1], "float32")
        d = channels_last(call.output_grad, layer.data_format)
        return reshape_per_example(u, [-1, u.shape[-1]]), reshape_per_example(d, [-1, d.shape[-1]])

    u, d = along_time(calls, positions)
    return u, d


def depthwise_pairs(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per call, the input and the gradient at the depthwise output, channels last."""
    return [
        (
            channels_last(call.inputs, layer.data_format),
            ops.cast(call.output_grads[1], "float32"),  # type: ignore[index]
        )
        for call in calls
    ]


def pointwise_dot(layer: Any, intermediate: Any, targets: Any, reference: Reference) -> Any:
    """`(B,)` `<U_i^T D_i, R_pointwise>` from `sequences`' `U` and `D`."""
    pointwise = layer.pointwise_kernel
    pointwise_reference = ops.reshape(reference(pointwise), pointwise.shape[-2:])
    response = ops.einsum("bpc,cf->bpf", intermediate, pointwise_reference)
    return ops.sum(response * targets, axis=(1, 2))


def separable_primitives(
    layer: Any, calls: Sequence[LayerCall], reference: Reference | None
) -> LayerPrimitives:
    """Per-example squared norm and dot with the reference for SeparableConv1D/2D.

    Example:

    ```python
    # U_i = depthwise(x_i) (P, C * M), D_i (P, filters), both from the tap:
    # g_i[pointwise] = U_i^T D_i,  g_i[depthwise] = the depthwise rule's with D_i W_p^T
    ```
    """
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    terms = []
    if pointwise.trainable:
        intermediate, targets = sequences(layer, calls)
        terms.append(
            LayerPrimitives(
                sq_norm=sequence_kernel_sq_norm(intermediate, targets, calls[0].xla),
                dot=None
                if reference is None
                else pointwise_dot(layer, intermediate, targets, reference),
            )
        )
    if depthwise.trainable:
        slices, grads = stacked_windows(depthwise_pairs(layer, calls), Window.of(layer))
        depthwise_reference = None
        if reference is not None:
            depthwise_reference = ops.reshape(reference(depthwise), (len(slices), 1, -1))
        terms.append(
            grouped_kernel_primitives(
                slices, grads, depthwise.shape[-2], depthwise_reference, calls[0].xla
            )
        )
    return with_bias(layer, calls, reference, terms)


def separable_dot(layer: Any, calls: Sequence[LayerCall], reference: Reference) -> Any:
    """`(B,)` `<g_i, R>` without per-example gradients: the depthwise convolution of
    the inputs with R's depthwise kernel paired with the gradient at `U_i`, `U_i`
    times R's pointwise kernel paired with `D_i`, and the bias term."""
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    terms = []
    if pointwise.trainable:
        terms.append(pointwise_dot(layer, *sequences(layer, calls), reference))
    if depthwise.trainable:
        kernel = reference(depthwise)
        for source, target in depthwise_pairs(layer, calls):
            options = convolution_options(layer, data_format="channels_last")
            outputs = ops.depthwise_conv(ops.cast(source, "float32"), kernel, **options)
            terms.append(paired(outputs, target))
    return with_bias_dot(layer, calls, reference, terms)


def separable_materializes(layer: Any, calls: Sequence[LayerCall]) -> bool:
    """Whether the pointwise kernel's per-example gradients cost less than its direct
    form (the depthwise kernel's are small: the direct form builds them too)."""
    if not layer.pointwise_kernel.trainable:
        return True
    positions = positions_per_example(
        [call.tapped[0] for call in calls], layer.data_format == "channels_first"
    )
    width_in, filters = layer.pointwise_kernel.shape[-2:]
    return not gram_is_cheaper(positions, width_in, filters, dots=True)


def separable_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of a SeparableConv1D/2D layer's kernels and bias."""
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    pairs = []
    if depthwise.trainable:
        window = Window.of(layer)
        channels = depthwise.shape[-2]
        grads = per_example_filter_gradients(
            depthwise_pairs(layer, calls), window, channels, xla=calls[0].xla
        )
        pairs.append((depthwise, grads))
    if pointwise.trainable:
        intermediate, targets = sequences(layer, calls)
        pairs.append((pointwise, ops.einsum("bpc,bpf->bcf", intermediate, targets)))
    bias_grad = per_example_bias_gradient(layer, calls)
    if bias_grad is not None:
        pairs.append((layer.bias, bias_grad))
    return pairs


SEPARABLE_CONV = Rule(
    "separable_conv",
    separable_primitives,
    has_plain_weights,
    tap=separable_tap,
    per_example=separable_per_example,
    materializes=separable_materializes,
    dot=separable_dot,
    kernels=lambda layer, calls: filter_gradient_kernel(
        layer.depthwise_kernel.shape[-2],
        layer.depthwise_kernel.shape[-2],
        Window.of(layer),
        calls[0].xla,
    ),
)
