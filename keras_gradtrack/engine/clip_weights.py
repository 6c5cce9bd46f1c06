"""Each example's clipping weight in a private step, from its per-layer squared norms.

Written once in `keras.ops`: the TensorFlow engine's private step
(`engine/clipping.py`), the JAX engine's (`backends/jax/private_step.py`) and the
fraction clipped a gradient logger records (`engine/private_logs.py`) all take their
weights from here. The two private steps look `clip_weights` up through this module
when they are traced: the one seam that the audit's control
(`privacy_audit.clipping_off`) replaces for both.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack.engine.private_settings import PrivacySettings, layer_groups


def clip_weights(
    settings: PrivacySettings,
    model: Any,
    plan: Sequence[Any],
    sq_norms: Sequence[Any],
    bound: Any,
) -> tuple[list[Any], Any]:
    """Per layer, each example's `(B,)` clipping weight `w_i`, and which examples were
    clipped (`(B,)` booleans), from the layers' `(B,)` squared norms (true scale).

    One bound: `w_i = min(1, C / ||g_i||)`, `C` = `bound` (this step's bound: the
    settings' sensitivity, or with adaptive clipping the bound variable's value).
    With bounds per group, every layer of group k takes the weight
    `min(1, C_k / ||g_i^(k)||)`, `||g_i^(k)||^2` the sum of its layers' squared
    norms; an example is clipped when some group is.

    Example:

    ```python
    weights, clipped = clip_weights(settings, model, plan, [sq_a, sq_b], 1.0)
    weights[0]          # (B,) min(1, 1 / sqrt(sq_a + sq_b))
    ```
    """
    groups = layer_groups(settings, model, tuple(plan))
    if groups is None:
        norms = ops.sqrt(functools.reduce(operator.add, list(sq_norms)))
        return [ops.minimum(1.0, bound / norms)] * len(plan), ops.greater(norms, bound)
    group_norms = [
        ops.sqrt(
            functools.reduce(
                operator.add, [sq for sq, k in zip(sq_norms, groups.index) if k == group]
            )
        )
        for group in range(len(groups.names))
    ]
    group_weights = [ops.minimum(1.0, c / n) for c, n in zip(groups.bounds, group_norms)]
    clipped = ops.any(
        ops.stack([ops.greater(n, c) for c, n in zip(groups.bounds, group_norms)], axis=1), axis=1
    )
    return [group_weights[k] for k in groups.index], clipped


def step_divisor(settings: PrivacySettings, batch: Any) -> Any:
    """What the clipped sum goes over: `B_expected`, or without one the batch's size
    (`batch`: an int, or a tensor: the global batch under `tf.distribute`). Keras'
    gradient accumulation applies the mean of k physical batches' gradients, so with
    `accumulation_steps` k each goes over `B_expected / k` (only the k-th carries the
    logical batch's noise: the backend's step says when). Every backend's private
    step divides by it."""
    if settings.expected_batch_size is None:
        return batch
    return float(settings.expected_batch_size) / settings.accumulation_steps
