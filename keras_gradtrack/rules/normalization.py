"""Rules for LayerNormalization, GroupNormalization and RMSNormalization.

Each of these layers computes `y = n(x) * gamma + beta`, where `n(x)` is the
input normalized over some axes of one example (no other example enters) and
`gamma`, `beta` broadcast over the remaining positions. With `d_i` the gradient
at the layer's output, example i's parameter gradients are
`sum_pos d_i * n(x_i)` and `sum_pos d_i`: as small as the parameters, so they
are materialized. `n(x)` is recomputed from the recorded input as the layer
computes it (float32, same epsilon and axes), by `keras_gradtrack.rule_math` in
`keras.ops`, as the JAX engine's rules do. GroupNormalization's mean and
inverse deviation are constant over the positions summed per channel, so its
rule sums `d_i * x_i` and `d_i` per channel and applies them there, with the
layer's own moments: the step's graph computes those once for the layer and the
rule, and no tensor of `n(x)` exists.
"""

from __future__ import annotations

from typing import Any

from keras_gradtrack import rule_math
from keras_gradtrack._keras_seam import reshape_into_groups
from keras_gradtrack.rules.contract import LayerCall, Rule
from keras_gradtrack.rules.ops import (
    StatisticsFn,
    normalization_per_example,
    scale_of_moments,
    scale_of_normalized,
)


def layer_normalization_applies(layer: Any) -> bool:
    """The rule covers LayerNormalization unless it may normalize over the batch axis.

    Example:

    ```python
    # x: (B, T, C), axis=-1  =>  g_i(gamma) = sum_t d_it * xhat_it,  g_i(beta) = sum_t d_it
    ```
    """
    return rule_math.excludes_batch_axis(layer, layer.axis)


def group_normalization_applies(layer: Any) -> bool:
    """The rule covers GroupNormalization unless its channel axis may be the batch axis."""
    return rule_math.excludes_batch_axis(layer, layer.axis)


def group_normalization_statistics(layer: Any) -> StatisticsFn:
    """GroupNormalization's moments per example, one value per channel
    (`rule_math.group_moments`) of the input in the layer's own groups: the step's graph
    shares the reshape and the moments with the layer's forward pass.

    The input is normalized over every non-batch axis within each group of
    channels; gamma and beta span the channel axis.

    Example:

    ```python
    # x: (B, H, W, C)  =>  g_i(gamma) = sum_{h,w} d_ihw * xhat_ihw   (C,)
    ```
    """
    epsilon = rule_math.epsilon_of(layer)

    def statistics(x: Any, call: LayerCall) -> tuple[Any, Any]:
        return rule_math.group_moments(reshape_into_groups(layer, x), layer.axis, epsilon)

    return statistics


def rms_normalization_applies(layer: Any) -> bool:
    """The rule covers RMSNormalization over trailing axes (`rule_math.spans_trailing_axes`).

    Example:

    ```python
    # x: (B, T, C), axis=-1  =>  g_i(scale) = sum_t d_it * x_it / rms(x_it)
    ```
    """
    return rule_math.spans_trailing_axes(layer)


# Normalization parameters are as small per example as in total: always materialized.
LAYER_NORMALIZATION = Rule.from_per_example(
    "layer_normalization",
    normalization_per_example(scale_of_normalized(rule_math.layer_normalized), "gamma", "beta"),
    applies=layer_normalization_applies,
)
GROUP_NORMALIZATION = Rule.from_per_example(
    "group_normalization",
    normalization_per_example(scale_of_moments(group_normalization_statistics), "gamma", "beta"),
    applies=group_normalization_applies,
)
RMS_NORMALIZATION = Rule.from_per_example(
    "rms_normalization",
    normalization_per_example(scale_of_normalized(rule_math.rms_normalized), "scale", None),
    applies=rms_normalization_applies,
)
