"""Per-example kernel gradients of the convolution family by TensorFlow's own filter
gradients, with the examples as groups or channels of one convolution.

`per_example_filter_gradients` picks, per layer and machine: the depthwise
filter gradient for depthwise kernels (CPU with or without oneDNN, GPU; not
under XLA), the grouped `Conv2DBackpropFilter` for ungrouped kernels where
oneDNN runs it (CPU with `TF_ENABLE_ONEDNN_OPTS` on, no GPU, not under XLA),
and the windows' products (`keras_gradtrack.rules.windows`) everywhere else.
`filter_gradient_kernel` names the choice for the summary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack._keras_seam import is_onednn_enabled
from keras_gradtrack.rules import chunks
from keras_gradtrack.rules.contract import DotFn, LayerCall, PerExampleFn, Rule, RuleFn
from keras_gradtrack.rules.windows import (
    FEW_CHANNELS,
    Pairs,
    Window,
    padded,
    per_example_bias_gradient,
    per_example_kernel_gradients,
    sizes,
    stacked_windows,
)

DEPTHWISE = "DepthwiseConv2dNativeBackpropFilter, examples as channels"
GROUPED = "Conv2DBackpropFilter (oneDNN), examples as groups"
WINDOWS = "window products"


def filter_gradient_form(
    groups: int, channels: int | None, window: Window, xla: bool = False
) -> str:
    """Which kernel computes the per-example kernel gradients for these shapes here
    (`xla`: in a step compiled by XLA).

    Up to `FEW_CHANNELS` ungrouped channels (an image input), the windows' one
    product over all offsets (faster than the depthwise filter gradient there,
    and without its copy of the output gradient); a 1x1 kernel,
    the one product of its one window (the input itself, at stride 1); depthwise
    kernels (one channel per group) the depthwise filter gradient
    (`depthwise_native`); other ungrouped 1-D and 2-D kernels the grouped
    `Conv2DBackpropFilter` where oneDNN runs it (`grouped_filter_native`); the
    rest the windows' products.
    """
    if groups == 1 and ((channels or 0) <= FEW_CHANNELS or math.prod(window.kernel_size) == 1):
        return WINDOWS
    if groups == channels and depthwise_native(window, xla):
        return DEPTHWISE
    if groups == 1 and grouped_filter_native(window, xla):
        return GROUPED
    return WINDOWS


def per_example_filter_gradients(
    pairs: Pairs, window: Window, groups: int, one_chunk: bool = False, xla: bool = False
) -> tf.Tensor:
    """`(B, n)` per-example kernel gradients, summed over the calls' `(source, target)`
    pairs, by the kernel `filter_gradient_form` picks (`in_chunks`: `one_chunk` says
    the examples are at most one chunk; `xla`: the step is compiled by XLA)."""
    form = filter_gradient_form(groups, pairs[0][0].shape[-1], window, xla=xla)
    kernel = {DEPTHWISE: depthwise_filter_gradients, GROUPED: grouped_filter_gradients}.get(form)
    if kernel is not None:
        return tf.add_n([in_chunks(kernel, s, t, window, one_chunk) for s, t in pairs])
    if xla:
        # XLA plans the memory of the whole step itself.
        slices, targets = stacked_windows(pairs, window)
        return per_example_kernel_gradients(slices, targets, groups)

    def products(source: tf.Tensor, target: tf.Tensor, window: Window) -> tf.Tensor:
        slices, targets = stacked_windows([(source, target)], window)
        return per_example_kernel_gradients(slices, targets, groups)

    return tf.add_n([in_chunks(products, s, t, window, one_chunk) for s, t in pairs])


def filter_gradient_kernel(groups: int, channels: int, window: Window, xla: bool) -> str:
    """The summary's note for a materialized convolution: its kernel here."""
    form = filter_gradient_form(groups, channels, window, xla=xla)
    return f"per-example kernel gradients: {form}"


def depthwise_native(window: Window, xla: bool) -> bool:
    """Whether `depthwise_filter_gradients` applies: 1-D or 2-D windows, equal strides,
    no dilation, and not under XLA (which fuses the windows' products and sums into one
    loop, and runs a depthwise filter gradient over B x C channels as a grouped
    convolution)."""
    return (
        not xla
        and len(window.kernel_size) <= 2
        and len(set(window.strides)) == 1
        and all(rate == 1 for rate in window.dilation_rate)
    )


def grouped_filter_native(window: Window, xla: bool) -> bool:
    """Whether `grouped_filter_gradients` applies: a 1-D or 2-D window, and a grouped
    `Conv2DBackpropFilter` runs here (`grouped_filter_gradient_runs`)."""
    return len(window.kernel_size) <= 2 and grouped_filter_gradient_runs(xla)


def grouped_filter_gradient_runs(xla: bool = False) -> bool:
    """Whether TensorFlow runs a grouped `Conv2DBackpropFilter` (input channels a multiple
    of the filter's) here: only oneDNN's CPU kernel does, so oneDNN on
    (`TF_ENABLE_ONEDNN_OPTS`), no GPU the step could be placed on, and not under XLA.
    TensorFlow's own CPU kernel and the GPU kernels refuse such shapes at run time."""
    return not xla and onednn_cpu_only()


@functools.lru_cache(maxsize=1)
def onednn_cpu_only() -> bool:
    """oneDNN on and no GPU (fixed for the life of the process)."""
    return is_onednn_enabled() and not tf.config.list_logical_devices("GPU")


def in_chunks(
    gradients: Any, source: tf.Tensor, target: tf.Tensor, window: Window, one_chunk: bool
) -> tf.Tensor:
    """`gradients(source, target, window)`, `(B, n)`, computed a chunk of examples at a
    time (`chunks.chunk_loop`): each chunk's copies of the input and output gradient
    exist one chunk at a time. Without a loop where the examples are `one_chunk`
    (the engine's own loop cut them) or the traced batch fits one chunk."""
    if one_chunk or chunks.fits_one_chunk(source.shape[0]):
        return gradients(source, target, window)

    def per_chunk(start: tf.Tensor, end: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        return gradients(source[start:end], target[start:end], window), []

    rows, _ = chunks.chunk_loop(tf.shape(source)[0], per_chunk, source.dtype)
    return rows


def as_two_dimensional(
    source: tf.Tensor, target: tf.Tensor, window: Window
) -> tuple[tf.Tensor, tf.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """`source` padded for "valid" windows, and both tensors with one spatial axis
    made two (of size 1 first): `(source, target, kernel_size, strides, dilation_rate)`."""
    source = padded(source, sizes(target)[1:-1], window)
    kernel_size, strides, rates = window.kernel_size, window.strides, window.dilation_rate
    if len(kernel_size) == 1:
        source, target = source[:, tf.newaxis], target[:, tf.newaxis]
        kernel_size, strides, rates = (1, *kernel_size), (1, *strides), (1, *rates)
    return source, target, kernel_size, strides, rates


def examples_as_channels(tensor: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
    """`(B, H, W, C)` as one example of `B C` channels, `(1, H, W, B C)`.

    The axes move by einsum rather than tf.transpose, which oneDNN runs slower
    for such shapes (docs/performance.md).
    """
    shape = tf.shape(tensor)
    moved = tf.einsum("bhwc->hwbc", tensor)
    return tf.reshape(moved, [1, shape[1], shape[2], batch * tensor.shape[-1]])


def grouped_filter_gradients(source: tf.Tensor, target: tf.Tensor, window: Window) -> tf.Tensor:
    """`g_i[k] = S_ik^T D_i` for a 1-D or 2-D window by one grouped `Conv2DBackpropFilter`.

    The examples become the groups of one grouped convolution, `B C` channels
    in and `B F` out, so its filter gradient holds every example's kernel
    gradient in the kernel's layout, with no window copies. On CPU with oneDNN
    it runs as fast as the windows' products and holds much less memory (no
    `(B, P, C)` copy per kernel offset; `benchmarks/conv_kernels.py`).

    Args:
        source: `(B, *spatial, C)`, the tensor the kernel slides over.
        target: `(B, *positions, F)`, the gradient paired with its windows.
        window: The convolution's geometry (`grouped_filter_native` holds).
    """
    source, target, kernel_size, strides, rates = as_two_dimensional(source, target, window)
    channels, filters = source.shape[-1], target.shape[-1]
    batch = tf.shape(source)[0]
    gradient = tf.raw_ops.Conv2DBackpropFilter(
        input=examples_as_channels(source, batch),
        filter_sizes=tf.stack([*kernel_size, channels, batch * filters]),
        out_backprop=examples_as_channels(target, batch),
        strides=[1, *strides, 1],
        padding="VALID",
        dilations=[1, *rates, 1],
    )
    window_width = math.prod(kernel_size) * channels
    per_example = tf.reshape(gradient, [window_width, batch, filters])
    return tf.reshape(tf.einsum("kbf->bkf", per_example), [batch, window_width * filters])


def depthwise_filter_gradients(source: tf.Tensor, target: tf.Tensor, window: Window) -> tf.Tensor:
    """`g_i[k, c, m] = sum_p S_ik[p, c] D_i[p, c M + m]` by `DepthwiseConv2dNativeBackpropFilter`.

    The examples become channels: `B C` channels in, multiplier M, so the filter
    gradient of that depthwise convolution holds every example's kernel gradient.
    Its kernels exist on CPU (with or without oneDNN) and GPU; on CPU it runs
    about twice as fast as the windows' products and sums (batch 128, 16 x 16 x 48).

    Args:
        source: `(B, *spatial, C)`, the tensor the kernel slides over.
        target: `(B, *positions, C * M)`, the gradient at the depthwise output.
        window: The convolution's geometry (`depthwise_native` holds).
    """
    source, target, kernel_size, _, _ = as_two_dimensional(source, target, window)
    channels, width = source.shape[-1], target.shape[-1]
    batch = tf.shape(source)[0]
    stride = window.strides[0]
    gradient = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
        input=examples_as_channels(source, batch),
        filter_sizes=tf.stack([*kernel_size, batch * channels, width // channels]),
        out_backprop=examples_as_channels(target, batch),
        strides=[1, stride, stride, 1],
        padding="VALID",
    )
    per_example = tf.reshape(gradient, [math.prod(kernel_size), batch, width])
    return tf.reshape(tf.einsum("kbc->bkc", per_example), [batch, -1])


def kernel_and_bias_per_example(
    layer: Any, calls: Sequence[LayerCall], windowed: Pairs, groups: int
) -> list[tuple[Any, tf.Tensor]]:
    """Per-example gradients of a (grouped) convolution's kernel and bias.

    Args:
        layer: The layer (its kernel, bias, geometry).
        calls: Its calls in this step.
        windowed: Per call, `(source, target)`: the kernel's windows slide over
            the source at the target's positions (`channels_last_pairs`, or the swapped
            roles of a transposed convolution).
        groups: Number of channel groups.
    """
    pairs = []
    if layer.kernel.trainable:
        first = calls[0]
        kernel_grad = per_example_filter_gradients(
            windowed, Window.of(layer), groups, one_chunk=first.one_chunk, xla=first.xla
        )
        pairs.append((layer.kernel, kernel_grad))
    bias_grad = per_example_bias_gradient(layer, calls)
    if bias_grad is not None:
        pairs.append((layer.bias, bias_grad))
    return pairs


def convolution_rule(
    name: str,
    functions: tuple[RuleFn, PerExampleFn, Callable[..., bool], DotFn],
    applies: Callable[[Any], bool],
    grouping: Callable[[Any], tuple[int, int]],
) -> Rule:
    """The rule of a convolution family from its `(primitives, per_example,
    materializes, dot)` functions; `grouping(layer)` is `(groups, channels)` of its
    per-example filter gradient (the summary names the kernel that computes it)."""
    primitives, per_example, materializes, dot = functions
    return Rule(
        name,
        primitives,
        applies,
        per_example=per_example,
        materializes=materializes,
        dot=dot,
        kernels=lambda layer, calls: filter_gradient_kernel(
            *grouping(layer), Window.of(layer), calls[0].xla
        ),
    )
