"""The one tolerance rule of every oracle comparison, on either backend (no backend
imports here: tests/oracle.py and tests/jax_backend/jax_oracle.py both use it).

In float32, an entry may differ by RTOL of itself plus FLOOR of its statistic's scale
(the largest finite magnitude of the oracle's values of that statistic). The floor is
for values that are exactly zero in exact arithmetic (a masked position's gradient, a
bias that a softmax ignores): float32 leaves them as rounding residue of terms of the
statistic's scale, a few float32 epsilons (1.2e-7) of it, which no relative bound
admits (6.8e-11 against 4.5e-11). FLOOR is 8 epsilons: an error of RTOL relative to a
value of normal size still fails, and so does any value more than 1e-6 of the scale
away from the oracle's (tests/test_oracle_tolerance.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

RTOL = 1e-4
FLOOR = 1e-6
# Cosines are bounded by 1, their scale; one is a ratio of rounded dot products,
# so its floor is wider.
COSINE_ATOL = 1e-5
# A ratio with a difference in its numerator: allow its conditioning.
NOISE_SCALE_RTOL = 1e-3

# What a step returns besides statistics.
BOOKKEEPING = ("batch_size", "example_id", "learning_rate")


def tolerance(name: str, expected: Any) -> tuple[float, float]:
    """`(rtol, atol)` for statistic `name` whose oracle values are `expected`."""
    if "cosine" in name:
        return RTOL, COSINE_ATOL
    values = np.abs(np.asarray(expected, np.float64))
    finite = values[np.isfinite(values)]
    scale = float(finite.max()) if finite.size else 0.0
    return (NOISE_SCALE_RTOL if name == "noise_scale" else RTOL), FLOOR * scale


def assert_statistic_matches(name: str, value: Any, expected: Any) -> None:
    """`value` equals the oracle's `expected` for statistic `name` up to `tolerance`."""
    rtol, atol = tolerance(name, expected)
    np.testing.assert_allclose(
        np.asarray(value, np.float64), expected, rtol=rtol, atol=atol, err_msg=name
    )


def assert_matches_oracle(stats: dict[str, Any], expected: dict[str, Any]) -> None:
    """Compares every statistic in `stats` with the oracle's value; a statistic the
    oracle does not know fails (it would otherwise go unchecked)."""
    unknown = sorted(set(stats) - set(expected) - set(BOOKKEEPING))
    assert not unknown, f"no oracle value for {unknown}"
    compared = 0
    for name, value in stats.items():
        if name in BOOKKEEPING:
            continue
        assert_statistic_matches(name, value, expected[name])
        compared += 1
    assert compared > 0, "nothing was compared"
