"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021).

The bound `C` follows a quantile of the per-example norms instead of being fixed. At
each step `t`, with the step's bound `C_t` and its `B` examples:

    b_t     = (sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, sigma_b^2)) / B_expected + 1/2
    C_{t+1} = C_t exp(-eta_C (b_t - gamma))

`gamma` the target quantile, `eta_C` the bound's learning rate, `sigma_b` the count's
noise (`clipped_count_stddev`). The geometric update moves `C` down when more than a
fraction `gamma` of the examples were unclipped, up otherwise. With `B = B_expected`,
`b_t` is the paper's `(sum_i 1[||g_i|| <= C_t] + N(0, sigma_b^2)) / B_expected`; the
centred bits `1[...] - 1/2` are the paper's device for a query of sensitivity 1/2, and
centring by each example rather than by `B_expected / 2` keeps it so when the batch's
size is itself random (Poisson sampling: adding an example moves the sum by 1/2 either
way).

The count is a second Gaussian query on the same examples, of sensitivity 1/2, so the
pair of queries together is one Gaussian mechanism whose noise multiplier is
`(sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2)` (the paper's Theorem 1). To keep the user's
`sigma` (what the accountant is told), the gradient's noise multiplier is lowered to
`sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`, which needs `2 sigma_b > sigma`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras


@dataclasses.dataclass(frozen=True)
class AdaptiveClip:
    """How `make_private(..., adaptive_clip=AdaptiveClip(...))` moves the bound.

    The bound starts at `make_private`'s `l2_norm_clip` and moves each step
    geometrically toward the `target_quantile` of the per-example norms
    (`docs/privacy.md`, "Adaptive clipping").

    Attributes:
        target_quantile: `gamma` in [0, 1]: the fraction of examples to leave unclipped
            (the paper's default 0.5: the median norm).
        learning_rate: `eta_C > 0`, the step of the geometric update (the paper: 0.2).
        clipped_count_stddev: `sigma_b >= 0`, the standard deviation of the noise
            added to the count of unclipped examples (the paper suggests
            `B_expected / 20`). It must exceed half the noise multiplier; 0 (a
            noiseless count) is not private, like `noise_multiplier=0`.

    Example:

    ```python
    model.make_private(
        l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=256,
        adaptive_clip=kgt.privacy.AdaptiveClip(0.5, 0.2, clipped_count_stddev=256 / 20),
    )
    ```
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    clipped_count_stddev: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("target_quantile", self.target_quantile, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("learning_rate", self.learning_rate, lambda v: v > 0, "> 0"),
            ("clipped_count_stddev", self.clipped_count_stddev, lambda v: v >= 0, ">= 0"),
        )
        for name, value, valid, wanted in checks:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and valid(value)):
                raise ValueError(
                    f"Expected AdaptiveClip's {name} {wanted}. Received: {name}={value!r}"
                )


def gradient_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """The gradient's noise multiplier that keeps the pair (clipped sum, count) at the
    privacy of one Gaussian mechanism of `noise_multiplier`: `(sigma^-2 - (2
    sigma_b)^-2)^(-1/2)` (Andrew et al. 2021, Theorem 1). A noiseless count
    (`sigma_b = 0`, not private) or no noise leaves `sigma` as it is.

    Raises:
        ValueError: When `2 sigma_b <= sigma` (the count alone would spend more than
            the whole budget).

    Example:

    ```python
    gradient_noise_multiplier(1.0, 5.0)   # (1 - 1/100)^(-1/2) = 1.00504
    ```
    """
    if noise_multiplier == 0 or clipped_count_stddev == 0:
        return noise_multiplier
    if 2 * clipped_count_stddev <= noise_multiplier:
        raise ValueError(
            "Adaptive clipping needs 2 * clipped_count_stddev > noise_multiplier (the "
            "count's share of the privacy budget must leave some for the gradient). "
            f"Received: clipped_count_stddev={clipped_count_stddev!r}, "
            f"noise_multiplier={noise_multiplier!r}"
        )
    return (noise_multiplier**-2 - (2 * clipped_count_stddev) ** -2) ** -0.5


def next_bound(
    bound: Any,
    unclipped_count: Any,
    batch_size: Any,
    count_noise: Any,
    divisor: Any,
    clip: AdaptiveClip,
) -> Any:
    """`C_{t+1} = C_t exp(-eta_C (b_t - gamma))`, with
    `b_t = (unclipped - batch_size / 2 + noise) / divisor + 1/2` (the module's docstring).

    Works on Python numbers and on tensors (`keras.ops`: every backend).

    Example:

    ```python
    next_bound(1.0, 80, 100, 0.0, 100, AdaptiveClip(0.5, 0.2))   # exp(-0.2 * 0.3) = 0.9418
    ```
    """
    fraction = (unclipped_count - 0.5 * batch_size + count_noise) / divisor + 0.5
    step = -clip.learning_rate * (fraction - clip.target_quantile)
    if isinstance(step, (int, float)):
        return bound * math.exp(step)
    return bound * keras.ops.exp(step)
