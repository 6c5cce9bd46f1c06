"""Rule for BatchNormalization: per-example gradients of gamma and beta.

BatchNormalization computes `y = xhat * gamma + beta` per channel, with `xhat =
(x - mean) / sqrt(variance + epsilon)` and the moments those of the batch in
training mode (the layer is trainable and called with `training=True`) or its
moving moments in inference mode. `xhat` does not depend on gamma or beta, so
with `d_i` the gradient at example i's output, `g_i(gamma) = sum_pos d_i *
xhat_i` and `g_i(beta) = sum_pos d_i`: as small as the parameters, materialized.

In training mode `d_i` is example i's alone only when no other BatchNormalization
in training mode follows the layer; otherwise the engine computes the layer's
gamma and beta with the layers before it, through the batch statistics. The rule
does not cover batch renormalization (`renorm=True`), whose correction factors
also multiply gamma; such a layer is computed that way too.
"""

from __future__ import annotations

from typing import Any

from keras import ops

from keras_gradtrack._keras_seam import batch_moments
from keras_gradtrack.rule_math import uses_batch_statistics
from keras_gradtrack.rules.contract import LayerCall, Rule
from keras_gradtrack.rules.ops import StatisticsFn, normalization_per_example, scale_of_moments


def batch_normalization_applies(layer: Any) -> bool:
    """The rule covers BatchNormalization without batch renormalization."""
    return not getattr(layer, "renorm", False)


def moments_of_call(layer: Any, x: Any, call: LayerCall) -> tuple[Any, Any]:
    """`(mean, inverse)` of one call's float32 input `x`, with the moments the call used,
    shaped to broadcast against `x`: `xhat = (x - mean) * inverse`."""
    if uses_batch_statistics(layer, call.args, call.kwargs):
        mask = call.args[2] if len(call.args) > 2 else call.kwargs.get("mask")
        # Keras' own moments: the same reduction, and masked calls weigh positions alike.
        mean, variance = batch_moments(layer, x, mask)
    else:
        mean, variance = layer.moving_mean, layer.moving_variance
    shape = [1] * len(x.shape)
    axis = layer.axis % len(x.shape)
    shape[axis] = x.shape[axis]
    mean = ops.reshape(ops.cast(mean, "float32"), shape)
    variance = ops.reshape(ops.cast(variance, "float32"), shape)
    return mean, ops.rsqrt(variance + layer.epsilon)


def batch_normalization_statistics(layer: Any) -> StatisticsFn:
    """BatchNormalization's moments, as each call used them.

    Example:

    ```python
    # x: (B, H, W, C)  =>  g_i(gamma) = sum_{h,w} d_ihw * xhat_ihw,  g_i(beta) = sum_{h,w} d_ihw
    ```
    """
    return lambda x, call: moments_of_call(layer, x, call)


BATCH_NORMALIZATION = Rule.from_per_example(
    "batch_normalization",
    normalization_per_example(scale_of_moments(batch_normalization_statistics), "gamma", "beta"),
    applies=batch_normalization_applies,
)
