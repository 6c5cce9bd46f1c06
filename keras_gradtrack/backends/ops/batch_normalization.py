"""The probed engines' rule for BatchNormalization (JAX, PyTorch): per-example gradients of gamma and beta.

`y = xhat * gamma + beta` per channel, `xhat = (x - mean) * inverse` with the batch's
moments in training mode (opted in: `track_batch_normalization`) or the moving ones in
inference mode. `xhat` does not depend on gamma or beta, so `g_i(gamma) = sum_pos d_i
xhat_i` and `g_i(beta) = sum_pos d_i` (`rule_math.scale_from_moments`, the TensorFlow
rule's math). In training mode `d_i` is example i's alone only where no other
BatchNormalization in training follows; otherwise the layer is coupled
(`coupled.py` of each backend), as on TensorFlow. Batch renormalization (`renorm=True`) is not covered:
its corrections also multiply gamma, and the layer is coupled.

Example:

```python
# x: (B, H, W, C)  =>  g_i(gamma) = sum_{h,w} d_ihw * xhat_ihw,  g_i(beta) = sum_{h,w} d_ihw
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack import rule_math
from keras_gradtrack._keras_seam import batch_moments
from keras_gradtrack.backends.ops.rules import ProbedCall, ProbedRule


def moments_of_call(layer: Any, x: Any, call: ProbedCall, others: Sequence[Any]) -> tuple[Any, Any]:
    """`(mean, inverse)` the call normalized its float32 input `x` with, shaped to
    broadcast against it (`others`: the values of the layer's non-trainable variables)."""
    if rule_math.uses_batch_statistics(layer, (call.inputs,), call.kwargs):
        # Keras' own moments: the same reduction, and masked positions left out alike.
        mean, variance = batch_moments(layer, x, call.kwargs.get("mask"))
    else:
        moving = dict(zip([v.name for v in layer.non_trainable_variables], others))
        mean, variance = moving["moving_mean"], moving["moving_variance"]
    rank = len(x.shape)
    shape = [1] * rank
    shape[layer.axis % rank] = x.shape[layer.axis % rank]
    mean = ops.reshape(rule_math.f32(mean), shape)
    variance = ops.reshape(rule_math.f32(variance), shape)
    return mean, ops.rsqrt(variance + layer.epsilon)


def per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    x = rule_math.f32(call.inputs)
    kept = [layer.axis % len(x.shape)]
    grads = {}
    for variable in layer.trainable_variables:
        if variable.name == "gamma":
            mean, inverse = moments_of_call(layer, x, call, others)
            grads["gamma"] = rule_math.scale_from_moments(x, call.output_grad, mean, inverse, kept)
        elif variable.name == "beta":
            grads["beta"] = rule_math.affine_per_example(call.output_grad, None, kept)
    return [grads[v.name] for v in layer.trainable_variables]


BATCH_NORMALIZATION = ProbedRule(
    "batch_normalization", per_example, applies=lambda layer: not getattr(layer, "renorm", False)
)
