"""The cost model that picks each rule's form: Gram matrices, or materialized gradients.

Sizes are static where the traced shapes know them; the model counts
multiply-adds and passes over memory, calibrated on a CPU (see the constants).
"""

from __future__ import annotations

from typing import Any

# The two constants of the cost model, shared with the JAX engine's rules.
from keras_gradtrack.rule_math import MATERIALIZE_MAX_VALUES, MATERIALIZED_PASS_COST


def gram_is_cheaper(positions: int | None, width_in: int, width_out: int) -> Any:
    """Whether `||X_i^T D_i||^2` costs less as `<X_i X_i^T, D_i D_i^T>` (`P^2 (in + out)`)
    than by materializing `X_i^T D_i` (`P in out`), for `P` positions per example of
    `X_i` (P x in) and `D_i` (P x out). False when P is unknown; a boolean tensor when
    P is a scalar tensor (a size known only at run time)."""
    return positions is not None and positions * (width_in + width_out) < width_in * width_out


def materializing_is_cheaper(
    positions: int | None, width_in: int, width_out: int, groups: int = 1
) -> bool:
    """Whether a layer applied at `positions` per example (`X_i` P x in, `D_i` P x out,
    per group) costs less with its per-example gradients `X_i^T D_i` materialized.

    The direct form adds the Gram norms `P^2 (in + out)` and the dot `X_i R D_i^T`
    (`P in out`) per example to the step; materializing costs `P in out`, but that
    replaces the backward pass' weight gradient, leaving a few passes over the
    `in out` values. True when P is unknown. Per-example gradients of more than
    `MATERIALIZE_MAX_VALUES` values (over all `groups`) are materialized only where
    the Gram form costs more.
    """
    if positions is None or not gram_is_cheaper(positions, width_in, width_out):
        return True
    values = width_in * width_out
    direct = positions * values + positions**2 * (width_in + width_out)
    fits = groups * values <= MATERIALIZE_MAX_VALUES
    return fits and direct > MATERIALIZED_PASS_COST * values
