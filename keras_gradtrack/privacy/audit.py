"""An empirical lower bound on epsilon from one training run (Steinke, Nasr, Jagielski
2023, "Privacy Auditing with One (1) Training Run", NeurIPS 2023).

`m` canaries are each included in the training data with probability 1/2, independently.
After training, an auditor scores every canary, guesses the `k_in` highest scores "in" and
the `k_out` lowest "out" (it abstains on the rest) and counts its correct guesses `v` out
of `r = k_in + k_out`. For an `(eps, delta)`-DP training run, `v` is nearly dominated by
`Binomial(r, e^eps / (1 + e^eps))` (the paper's Theorem 3; with `delta = 0` exactly):

    P[V >= v] <= P[Binomial(r, q) >= v] + 2 m delta max_i P[v > Binomial(r, q) >= v - i] / i

with `q = e^eps / (1 + e^eps)` (the bound of the paper's Appendix, its delta term
included). The empirical epsilon is the largest `eps` whose p-value for the observed `v`
is below `1 - confidence`: a run that is `(eps', delta)`-DP with `eps' < eps` would give
so many correct guesses with probability under 5% (at confidence 0.95).

This module holds the auditor's statistics (numpy only); `keras_gradtrack.privacy_audit`
runs such an audit on the library's own private step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability of at least `correct` correct guesses out of `guesses` (of
    `canaries` canaries) under an `(epsilon, delta)`-DP run (the module's bound).

    Example:

    ```python
    p_value(1000, 100, 100, 3.0, 0.0)   # (e^3 / (1 + e^3))^100 = 0.0087
    ```
    """
    from scipy import stats

    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            "Expected 0 <= correct <= guesses <= canaries. Received: "
            f"correct={correct}, guesses={guesses}, canaries={canaries}"
        )
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beyond = float(stats.binom.sf(correct - 1, guesses, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or correct == 0:
        return min(beyond, 1.0)
    below = np.cumsum(stats.binom.pmf(correct - np.arange(1, correct + 1), guesses, q))
    alpha = float(np.max(below / np.arange(1, correct + 1)))
    return min(beyond + 2 * canaries * delta * alpha, 1.0)


def epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float = 0.0, confidence: float = 0.95
) -> float:
    """The largest epsilon that `correct` of `guesses` correct guesses refute at
    `confidence` (0 when none is refuted): a bisection on `p_value`.

    Example:

    ```python
    epsilon_lower_bound(1000, 100, 100)   # every guess right: 3.49
    epsilon_lower_bound(1000, 100, 50)    # chance: 0.0
    ```
    """
    level = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        if p_value(canaries, guesses, correct, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """One audit: the canaries, the guesses made, how many were right, the empirical
    lower bound on epsilon, and the canaries' scores and inclusions."""

    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float
    scores: np.ndarray
    included: np.ndarray


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    guesses_per_side: int,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> AuditResult:
    """Guesses the `guesses_per_side` highest scores "in" and as many lowest "out", and
    bounds epsilon from the correct guesses.

    Example:

    ```python
    result = audit_scores(scores, included, guesses_per_side=50, delta=1e-5)
    result.epsilon_lower_bound
    ```
    """
    scores, included = np.asarray(scores, np.float64), np.asarray(included, bool)
    if scores.shape != included.shape or 2 * guesses_per_side > scores.size:
        raise ValueError(
            "Expected one score per canary and at most half of them guessed per side. "
            f"Received: scores {scores.shape}, included {included.shape}, "
            f"guesses_per_side={guesses_per_side}"
        )
    order = np.argsort(scores, kind="stable")
    guessed_out, guessed_in = order[:guesses_per_side], order[-guesses_per_side:]
    correct = int(included[guessed_in].sum() + (~included[guessed_out]).sum())
    guesses = 2 * guesses_per_side
    bound = epsilon_lower_bound(scores.size, guesses, correct, delta, confidence)
    return AuditResult(scores.size, guesses, correct, bound, scores, included)
