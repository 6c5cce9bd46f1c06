"""Rules for LayerNormalization, GroupNormalization and RMSNormalization.

Each of these layers computes `y = n(x) * gamma + beta`, where `n(x)` is the
input normalized over some axes of one example (no other example enters) and
`gamma`, `beta` broadcast over the remaining positions. With `d_i` the gradient
at the layer's output, example i's parameter gradients are
`sum_pos d_i * n(x_i)` and `sum_pos d_i`: as small as the parameters, so they
are materialized. `n(x)` is recomputed from the recorded input as the layer
computes it (float32, same epsilon and axes). GroupNormalization's mean and
inverse deviation are constant over the positions summed per channel, so its
rule sums `d_i * x_i` and `d_i` per channel and applies them there, with the
layer's own moments: the step's graph computes those once for the layer and the
rule, and no tensor of `n(x)` exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_gradtrack._keras_seam import reshape_into_groups
from keras_gradtrack.rules.contract import LayerCall, Rule
from keras_gradtrack.rules.ops import StatisticsFn, normalization_per_example, normalized_axes


def built_input_rank(layer: Any) -> int | None:
    """The rank of the input the layer was built for, if Keras recorded it."""
    shape = (layer.get_build_config() or {}).get("input_shape")
    if shape is None or not isinstance(shape, (list, tuple)):
        return None
    return len(shape)


def excludes_batch_axis(layer: Any, axis: int | Sequence[int]) -> bool:
    """False when `axis` is (or may be) the batch axis of the layer's input."""
    rank = built_input_rank(layer)
    axes = [axis] if isinstance(axis, int) else list(axis)
    if rank is None:
        return all(a != 0 for a in axes)
    return all(a % rank != 0 for a in axes)


def epsilon_of(layer: Any) -> float:
    return keras.config.epsilon() if layer.epsilon is None else layer.epsilon


def layer_normalization_applies(layer: Any) -> bool:
    """The rule covers LayerNormalization unless it may normalize over the batch axis."""
    return excludes_batch_axis(layer, layer.axis)


def layer_normalization_statistics(layer: Any) -> StatisticsFn:
    """LayerNormalization's moments per example (also with `rms_scaling=True`).

    Example:

    ```python
    # x: (B, T, C), axis=-1  =>  g_i(gamma) = sum_t d_it * xhat_it,  g_i(beta) = sum_t d_it
    ```
    """
    epsilon = epsilon_of(layer)

    def statistics(x: tf.Tensor, call: LayerCall) -> tuple[tf.Tensor | None, tf.Tensor]:
        axes = normalized_axes(layer, layer.axis, x.shape.rank)
        if layer.rms_scaling:
            # The layer's (deprecated) rms_scaling divides by the standard deviation.
            variance = tf.math.reduce_variance(x, axis=axes, keepdims=True)
            return None, tf.math.rsqrt(variance + epsilon)
        mean, variance = tf.nn.moments(x, axes, keepdims=True)
        return mean, tf.math.rsqrt(variance + epsilon)

    return statistics


def group_normalization_applies(layer: Any) -> bool:
    """The rule covers GroupNormalization unless its channel axis may be the batch axis."""
    return excludes_batch_axis(layer, layer.axis)


def group_normalization_statistics(layer: Any) -> StatisticsFn:
    """GroupNormalization's moments per example, one value per channel.

    The input is normalized over every non-batch axis within each group of
    channels; gamma and beta span the channel axis.

    Example:

    ```python
    # x: (B, H, W, C)  =>  g_i(gamma) = sum_{h,w} d_ihw * xhat_ihw   (C,)
    ```
    """
    epsilon = epsilon_of(layer)

    def statistics(x: tf.Tensor, call: LayerCall) -> tuple[tf.Tensor, tf.Tensor]:
        # The layer's own reshape and moments, so the step's graph can share them with
        # the layer's forward pass: (B, ..., groups, channels // groups, ...).
        grouped = reshape_into_groups(layer, x)
        axis = layer.axis % x.shape.rank
        reduction = [a for a in range(1, grouped.shape.rank) if a != axis]
        mean, variance = keras.ops.moments(grouped, axes=reduction, keepdims=True)
        inverse = keras.ops.rsqrt(variance + epsilon)
        # (B, 1.., groups, 1, 1..) to the input's layout, one value per channel.
        spread = [1] * grouped.shape.rank
        spread[axis : axis + 2] = grouped.shape[axis : axis + 2]
        by_channel = [-1] + [1] * (x.shape.rank - 1)
        by_channel[axis] = x.shape[axis]

        def to_channels(moment: tf.Tensor) -> tf.Tensor:
            spread_out = tf.broadcast_to(moment, [tf.shape(moment)[0], *spread[1:]])
            return tf.reshape(spread_out, by_channel)

        return to_channels(mean), to_channels(inverse)

    return statistics


def rms_normalization_applies(layer: Any) -> bool:
    """The rule covers RMSNormalization over trailing axes.

    `ops.rms_normalization` broadcasts `scale` against the trailing axes of the
    input, whatever `axis` says; only when `axis` is those trailing axes is the
    rule's view (scale spans `axis`) the layer's.
    """
    axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
    rank = built_input_rank(layer)
    if rank is None:
        # Without the rank, only negative axes can be known to be trailing.
        return sorted(axes) == list(range(-len(axes), 0))
    resolved = sorted(a % rank for a in axes)
    return 0 not in resolved and resolved == list(range(rank - len(resolved), rank))


def rms_normalization_statistics(layer: Any) -> StatisticsFn:
    """RMSNormalization's inverse root mean square per example (no mean).

    Example:

    ```python
    # x: (B, T, C), axis=-1  =>  g_i(scale) = sum_t d_it * x_it / rms(x_it)
    ```
    """
    epsilon = epsilon_of(layer)

    def statistics(x: tf.Tensor, call: LayerCall) -> tuple[None, tf.Tensor]:
        axes = normalized_axes(layer, layer.axis, x.shape.rank)
        mean_square = tf.reduce_mean(tf.square(x), axis=axes, keepdims=True)
        return None, tf.math.rsqrt(mean_square + epsilon)

    return statistics


# Normalization parameters are as small per example as in total: always materialized.
LAYER_NORMALIZATION = Rule.from_per_example(
    "layer_normalization",
    normalization_per_example(layer_normalization_statistics, "gamma", "beta"),
    applies=layer_normalization_applies,
)
GROUP_NORMALIZATION = Rule.from_per_example(
    "group_normalization",
    normalization_per_example(group_normalization_statistics, "gamma", "beta", True),
    applies=group_normalization_applies,
)
RMS_NORMALIZATION = Rule.from_per_example(
    "rms_normalization",
    normalization_per_example(rms_normalization_statistics, "scale", None),
    applies=rms_normalization_applies,
)
