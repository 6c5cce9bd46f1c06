"""A privacy budget: `(target_epsilon, delta)` that no step may take a model past.

Before a step of the current phase `(sigma, q)` runs, the count of steps the budget
still allows is known: the largest `n` such that the history so far plus `n` more
steps composes to at most `target_epsilon`. It is found once per phase by a search
over `n` (epsilon grows with the steps), so each step's check is a comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras_gradtrack.privacy.accounting import (
    dp_accounting,
    fresh_accountant,
    history_event,
    orders_left_out_quietly,
)
from keras_gradtrack.privacy.history import PrivacyPhase

# No training reaches this many steps; the search for the steps left stops there.
MOST_STEPS = 2**40


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
    """The `(target_epsilon, delta)` a model may spend, by an accountant's measure.

    Example:

    ```python
    model.make_private(l2_norm_clip=1.0, target_epsilon=3.0, delta=1e-5, epochs=10,
                       sampling_rate=0.01)
    model.privacy_settings.budget   # PrivacyBudget(target_epsilon=3.0, delta=1e-05, ...)
    ```
    """

    target_epsilon: float
    delta: float
    accountant: str = "rdp"


def epsilon_after(
    budget: PrivacyBudget, spent: Sequence[PrivacyPhase], sigma: float, q: float
) -> Any:
    """`epsilon(n)`: the epsilon of `spent` plus `n` steps of `(sigma, q)`, at the
    budget's delta. RDP adds one step's curve `n` times over the history's (one
    conversion per `n`); PLD composes anew."""
    dpa = dp_accounting()
    spent = [phase for phase in spent if phase.steps]
    if budget.accountant == "rdp":
        prior = fresh_accountant("rdp")
        prior.compose(history_event(spent))
        one = fresh_accountant("rdp")
        one.compose(history_event([PrivacyPhase(sigma, q, 1)]))

        def rdp_epsilon(n: int) -> float:
            curve = prior.rdp + n * one.rdp if n else prior.rdp  # 0 * inf is nan
            with orders_left_out_quietly():
                return float(dpa.rdp.compute_epsilon(one.orders, curve, budget.delta)[0])

        return rdp_epsilon

    def pld_epsilon(n: int) -> float:
        found = fresh_accountant("pld")
        found.compose(history_event([*spent, PrivacyPhase(sigma, q, n)]))
        with orders_left_out_quietly():
            return float(found.get_epsilon(budget.delta))

    return pld_epsilon


def steps_left(budget: PrivacyBudget, spent: Sequence[PrivacyPhase], sigma: float, q: float) -> int:
    """The most steps of `(sigma, q)` after the `spent` phases within the budget.

    Example:

    ```python
    steps_left(PrivacyBudget(3.0, 1e-5), model.privacy_history[:-1], 1.1, 0.01)
    ```
    """
    if sigma == 0:
        return 0
    epsilon = epsilon_after(budget, spent, sigma, q)
    if epsilon(0) > budget.target_epsilon:
        return 0
    low, high = 0, 1  # epsilon(low) within the budget; find a high past it
    while epsilon(high) <= budget.target_epsilon:
        low, high = high, 2 * high
        if high > MOST_STEPS:
            return MOST_STEPS
    while high - low > 1:
        middle = (low + high) // 2
        if epsilon(middle) <= budget.target_epsilon:
            low = middle
        else:
            high = middle
    return low
