"""The convolution family's windowing: the shared math of the conv, depthwise,
separable and transposed-convolution rules.

A convolution is a Dense layer applied to every window of its input. With
`S_ik` the input values that example i's kernel offset k sees at each output
position (positions x input channels) and `D_i` the gradient at the
pre-activation output (positions x filters), the kernel gradient at offset k
is `S_ik^T D_i`, per group of channels. The windows are read as one strided
slice of the padded input per kernel offset, so the patch tensor
(positions x kernel size x channels) is never built as a whole. Per layer, the
squared norm comes from whichever form costs less: the per-example kernel
gradients themselves, or the Gram form `<sum_k S_ik S_ik^T, D_i D_i^T>`.
`channels_first` tensors are transposed to `channels_last` first.

Each form has a path on kernels every TensorFlow build has, on CPU (with or
without oneDNN), GPU and under XLA: strided slices, elementwise products and
sums, matrix products and einsums. TensorFlow's own
filter gradients with the examples as groups are in
`keras_gradtrack.rules.filter_gradients`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack.rule_math import gram_has_fewer_products, total
from keras_gradtrack.rules.contract import LayerCall, LayerPrimitives, Reference
from keras_gradtrack.rules.ops import (
    materialized,
    references_of,
    reshape_per_example,
    summed,
    summed_bias_gradient,
    zero_primitives,
)

# Up to this many input channels, the per-example kernel gradient is one matrix
# product over all offsets' windows at once: fewer, larger products win while the
# inner size is tiny (docs/performance.md).
FEW_CHANNELS = 4

# A static size, or a scalar tensor when the size is only known at run time.
Size = Any


@dataclasses.dataclass(frozen=True)
class Window:
    """How a convolution slides its kernel over the spatial axes of one example.

    Attributes:
        kernel_size: Kernel extent per spatial axis.
        strides: Step between output positions per spatial axis.
        dilation_rate: Step between kernel taps per spatial axis.
        padding: `"valid"`, `"same"` (TensorFlow's rule: the extra padding goes
            after) or `"causal"` (all padding before).
    """

    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]
    dilation_rate: tuple[int, ...]
    padding: str

    @classmethod
    def of(cls, layer: Any) -> Window:
        return cls(
            tuple(layer.kernel_size),
            tuple(layer.strides),
            tuple(layer.dilation_rate),
            layer.padding,
        )


def sizes(tensor: Any) -> list[Size]:
    """The tensor's shape: static sizes where known, scalar tensors elsewhere."""
    return list(ops.shape(tensor))


def channels_last(tensor: Any, data_format: str) -> Any:
    """The tensor as float32 `(B, *spatial, C)`."""
    tensor = ops.cast(tensor, "float32")
    if data_format == "channels_first":
        rank = len(tensor.shape)
        tensor = ops.transpose(tensor, (0, *range(2, rank), 1))
    return tensor


def padded(x: Any, output_size: Sequence[Size], window: Window) -> Any:
    """`x` padded so that a "valid" window at every output position fits."""
    shape = sizes(x)
    paddings: list[list[Size]] = [[0, 0]]
    for size, out, kernel, stride, rate in zip(
        shape[1:-1], output_size, window.kernel_size, window.strides, window.dilation_rate
    ):
        extent = (kernel - 1) * rate + 1
        if window.padding == "valid":
            paddings.append([0, 0])
        elif window.padding == "causal":
            paddings.append([extent - 1, 0])
        else:
            total = (out - 1) * stride + extent - size
            total = ops.maximum(total, 0) if ops.is_tensor(total) else max(total, 0)
            paddings.append([total // 2, total - total // 2])
    paddings.append([0, 0])
    if any(not isinstance(amount, int) or amount for pair in paddings for amount in pair):
        x = ops.pad(x, paddings)
    return x


def window_slices(x: Any, output_size: Sequence[Size], window: Window) -> list[Any]:
    """The input values under each kernel offset at every output position.

    Args:
        x: `(B, *spatial, C)` input of one call.
        output_size: The spatial size of the convolution's output.
        window: The convolution's geometry.

    Returns:
        One `(B, P, C)` tensor per kernel offset, in the kernel's row-major
        order, with `P` the number of output positions.
    """
    x = phase_split(padded(x, output_size, window), window.strides)
    slices = []
    for offset in itertools.product(*(range(kernel) for kernel in window.kernel_size)):
        index: list[Any] = [slice(None)]
        for tap, out, stride, rate in zip(
            offset, output_size, window.strides, window.dilation_rate
        ):
            start = tap * rate
            if stride == 1:
                index.append(slice(start, start + out))
            else:  # position start + p * stride is (start // stride + p, start % stride)
                index += [slice(start // stride, start // stride + out), start % stride]
        index.append(slice(None))
        slices.append(reshape_per_example(x[tuple(index)], [-1, x.shape[-1]]))
    return slices


def phase_split(x: Any, strides: Sequence[int]) -> Any:
    """`x` with each strided spatial axis of size n split into `(ceil(n / s), s)`.

    A window at stride s is then a unit-stride slice at one phase of the
    axis: CPU TensorFlow copies a strided slice element by element, 4 to 7
    times slower (depthwise windows at stride 2, batch 128). The zeros padded
    at the end to fill the last row are never read.
    """
    if all(stride == 1 for stride in strides):
        return x
    shape = sizes(x)
    paddings: list[list[Size]] = [[0, 0]]
    split: list[Size] = [shape[0]]
    for size, stride in zip(shape[1:-1], strides):
        extra = -size % stride
        paddings.append([0, extra])
        split += [size] if stride == 1 else [(size + extra) // stride, stride]
    paddings.append([0, 0])
    if any(not isinstance(amount, int) or amount for _, amount in paddings):
        x = ops.pad(x, paddings)
    return ops.reshape(x, (*split, shape[-1]))


def stacked_windows(pairs: Sequence[tuple[Any, Any]], window: Window) -> tuple[list[Any], Any]:
    """Windows of each `source` at the positions of its `target`, all calls stacked.

    Args:
        pairs: Per call, `(source, target)`: the tensor the kernel slides over
            and the one paired with its windows, both `(B, *spatial, channels)`.
        window: The convolution's geometry.

    Returns:
        Per kernel offset a `(B, P, C_source)` tensor, and the `(B, P, C_target)`
        targets, with the positions of all calls concatenated (a shared
        layer's per-example gradient is the sum over its calls).
    """
    slices_per_call, targets = [], []
    for source, target in pairs:
        shape = sizes(target)
        slices_per_call.append(window_slices(source, shape[1:-1], window))
        targets.append(reshape_per_example(target, [-1, target.shape[-1]]))
    if len(pairs) == 1:
        return slices_per_call[0], targets[0]
    slices = [ops.concatenate(list(per_offset), axis=1) for per_offset in zip(*slices_per_call)]
    return slices, ops.concatenate(targets, axis=1)


def grouped_response(slices: Sequence[Any], kernel: Any, groups: int) -> Any:
    """The (bias-free) convolution output `sum_k S_k W_k`, per group: `(B, P, O)`.

    Args:
        slices: Per kernel offset, `(B, P, C)` windows.
        kernel: `(K, C / groups, O)` kernel.
        groups: Number of channel groups.
    """
    group_channels, filters = kernel.shape[1], kernel.shape[2]
    kernel = ops.reshape(kernel, (len(slices), group_channels, groups, -1))
    per_offset = [kernel[k] for k in range(len(slices))]
    batch = ops.shape(slices[0])[0]
    if group_channels == 1:  # depthwise: a broadcast product, not a degenerate einsum
        terms = [s[..., None] * w[0] for s, w in zip(slices, per_offset)]
    else:
        terms = [
            ops.einsum("bpgc,cgo->bpgo", ops.reshape(s, (batch, -1, groups, group_channels)), w)
            for s, w in zip(slices, per_offset)
        ]
    return ops.reshape(total(terms), (batch, -1, filters))


def per_example_kernel_gradients(slices: Sequence[Any], targets: Any, groups: int) -> Any:
    """`g_i[k] = S_ik^T D_i` per group, flattened in the kernel's layout: `(B, n)`.

    One matrix product per kernel offset (per group): the window copies and
    batched products run on every device, with or without oneDNN and under XLA.

    Args:
        slices: Per kernel offset, `(B, P, C)` windows.
        targets: `(B, P, O)`, the gradient paired with the windows.
        groups: Number of channel groups (input channel block j meets filter block j).
    """
    batch = ops.shape(targets)[0]
    channels = slices[0].shape[-1]
    group_channels = channels // groups
    if groups == 1 and channels <= FEW_CHANNELS:
        # Few channels (an image input): one product over all offsets' windows
        # beats one product per offset with a tiny inner size. Stacked as
        # (B, K, P, C), each offset's windows are one contiguous copy (faster than
        # interleaving them as (B, P, K * C)).
        windows = ops.stack(list(slices), axis=1)
        if windows.shape[-1] != 1:
            windows = ops.transpose(windows, (0, 1, 3, 2))
        windows = ops.reshape(windows, (batch, -1, ops.shape(targets)[1]))  # (B, K * C, P)
        return ops.reshape(ops.matmul(windows, targets), (batch, -1))
    if groups == 1:
        per_offset = [ops.einsum("bpc,bpo->bco", s, targets) for s in slices]
    elif group_channels == 1:
        # Depthwise: a product per position and channel, summed over positions
        # (an einsum here becomes one tiny matrix product per channel, much slower).
        multiplier = targets.shape[-1] // groups
        if multiplier == 1:
            per_offset = [ops.sum(s * targets, axis=1) for s in slices]
        else:
            grads = ops.reshape(targets, (batch, -1, groups, multiplier))
            per_offset = [ops.sum(s[..., None] * grads, axis=1) for s in slices]
    else:
        grads = ops.reshape(targets, (batch, -1, groups, targets.shape[-1] // groups))
        per_offset = [
            ops.einsum(
                "bpgc,bpgo->bcgo", ops.reshape(s, (batch, -1, groups, group_channels)), grads
            )
            for s in slices
        ]
    # (B, K, C / groups, groups, O / groups) is the kernel's own layout.
    return ops.reshape(ops.stack(per_offset, axis=1), (batch, -1))


def grouped_kernel_primitives(
    slices: Sequence[Any],
    targets: Any,
    groups: int,
    kernel_reference: Any | None,
    xla: bool = False,
) -> LayerPrimitives:
    """`||g_i||^2` and `<g_i, R>` for the kernel gradient `g_i[k] = S_ik^T D_i` per group.

    Args:
        slices: Per kernel offset, `(B, P, C)` windows.
        targets: `(B, P, O)`, the gradient paired with the windows.
        groups: Number of channel groups.
        kernel_reference: `(K, C / groups, O)`, the reference in the kernel's layout;
            None for no dot.
        xla: The step is compiled by XLA (`LayerCall.xla`).
    """
    group_channels = slices[0].shape[-1] // groups
    group_filters = targets.shape[-1] // groups
    if not gram_has_fewer_products(targets.shape[1], len(slices) * group_channels, group_filters):
        references = None if kernel_reference is None else [kernel_reference]
        return materialized(
            [per_example_kernel_gradients(slices, targets, groups)], references, xla
        )
    batch = ops.shape(targets)[0]
    grouped = [ops.reshape(s, (batch, -1, groups, group_channels)) for s in slices]
    grads = ops.reshape(targets, (batch, -1, groups, group_filters))
    gram_windows = total([ops.einsum("bpgc,bqgc->bgpq", s, s) for s in grouped])
    gram_grads = ops.einsum("bpgo,bqgo->bgpq", grads, grads)
    sq_norm = ops.sum(gram_windows * gram_grads, axis=(1, 2, 3))
    if kernel_reference is None:
        return LayerPrimitives(sq_norm=sq_norm, dot=None)
    response = grouped_response(slices, kernel_reference, groups)
    return LayerPrimitives(sq_norm=sq_norm, dot=ops.sum(response * targets, axis=(1, 2)))


def kernel_and_bias_primitives(
    layer: Any,
    calls: Sequence[LayerCall],
    reference: Reference | None,
    pairs: Pairs,
    groups: int,
    layout: Any,
) -> LayerPrimitives:
    """`||g_i||^2` and `<g_i, R>` of a convolution's kernel and bias: the kernel's
    windows slide over each pair's source at its target's positions
    (`grouped_kernel_primitives`), R reshaped to `(K, *layout)` (`layout`: the kernel's
    `(C / groups, O)` per offset)."""
    terms = []
    if layer.kernel.trainable:
        slices, targets = stacked_windows(pairs, Window.of(layer))
        kernel_reference = None
        if reference is not None:
            kernel_reference = ops.reshape(reference(layer.kernel), (len(slices), *layout))
        terms.append(
            grouped_kernel_primitives(slices, targets, groups, kernel_reference, calls[0].xla)
        )
    return with_bias(layer, calls, reference, terms)


def channels_last_pairs(layer: Any, calls: Sequence[LayerCall], swapped: bool = False) -> Pairs:
    """Per call, `(input, output gradient)` channels last: the kernel's windows slide
    over the input at the output's positions; `swapped`, `(output gradient, input)`, as
    for a transposed convolution's kernel."""
    pairs = []
    for call in calls:
        pair = (
            channels_last(call.inputs, layer.data_format),
            channels_last(call.output_grad, layer.data_format),
        )
        pairs.append(pair[::-1] if swapped else pair)
    return pairs


def per_example_bias_gradient(layer: Any, calls: Sequence[LayerCall]) -> Any | None:
    """`(B, filters)`, the output gradient summed over positions and calls; None without a trainable bias."""
    if layer.bias is None or not layer.bias.trainable:
        return None
    return summed_bias_gradient(calls, layer.bias.shape, layer.data_format == "channels_first")


def with_bias(
    layer: Any,
    calls: Sequence[LayerCall],
    reference: Reference | None,
    terms: list[LayerPrimitives],
) -> LayerPrimitives:
    """The layer's primitives: the given kernel terms plus the bias term."""
    bias_grad = per_example_bias_gradient(layer, calls)
    if bias_grad is not None:
        references = references_of(reference, [layer.bias])
        terms = [*terms, materialized([bias_grad], references, calls[0].xla)]
    if not terms:  # every variable of the layer is frozen
        return zero_primitives(calls[0].output_grad, reference)
    return summed(terms)


Pairs = list[tuple[Any, Any]]


def paired(outputs: Any, output_grad: Any) -> Any:
    """`(B,)` `<z_i, d_i>` over all axes but the batch (same layout)."""
    products = ops.cast(outputs, "float32") * ops.cast(output_grad, "float32")
    return ops.sum(ops.reshape(products, (ops.shape(products)[0], -1)), axis=1)


def convolution_options(layer: Any, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of `keras.ops.conv` and its siblings that repeat `layer`'s
    geometry, with `overrides`."""
    options = {
        "strides": layer.strides,
        "padding": layer.padding,
        "dilation_rate": layer.dilation_rate,
        "data_format": layer.data_format,
    }
    return {**options, **overrides}


def forward_dot(
    layer: Any,
    calls: Sequence[LayerCall],
    reference: Reference,
    forward: Any,
) -> Any:
    """`(B,)` `<g_i, R>` of a layer linear in its kernel and bias: `forward(inputs,
    kernel)` (the layer's own kernel map, float32) applied to each call's inputs with
    R's kernel, paired with the output gradients, plus the bias term."""
    terms = []
    if layer.kernel.trainable:
        kernel = reference(layer.kernel)
        for call in calls:
            outputs = forward(ops.cast(call.inputs, "float32"), kernel)
            terms.append(paired(outputs, call.output_grad))
    return with_bias_dot(layer, calls, reference, terms)


def with_bias_dot(
    layer: Any, calls: Sequence[LayerCall], reference: Reference, terms: list[Any]
) -> Any:
    """The layer's `<g_i, R>`: the given kernel terms plus the bias term."""
    bias_grad = per_example_bias_gradient(layer, calls)
    if bias_grad is not None:
        terms = [*terms, ops.sum(bias_grad * reference(layer.bias), axis=1)]
    if not terms:  # every variable of the layer is frozen
        return ops.zeros((ops.shape(calls[0].output_grad)[0],))
    return total(terms)
