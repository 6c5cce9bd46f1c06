"""The one-run audit (Steinke, Nasr, Jagielski 2023; `keras_gradtrack/privacy/audit.py`)
of the library's real private step with Dirac canaries: the empirical lower bound on
epsilon stays below the accountant's epsilon, and rises above it when the noise or the
clipping is taken out (so the audit can fail)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from keras_gradtrack.privacy import compute_epsilon
from keras_gradtrack.privacy.audit import audit_scores, epsilon_lower_bound, p_value
from keras_gradtrack.privacy_audit import clipping_off, dirac_canary_audit

# 1000 canaries, 4 full-batch steps at sigma 3: the accountant says epsilon 2.98 at
# delta 1e-5; 100 guesses each side, all right, would refute up to 4.17.
CANARIES, SIGMA, STEPS, PER_SIDE, DELTA = 1000, 3.0, 4, 100, 1e-5


def accountant_epsilon() -> float:
    return compute_epsilon(SIGMA, 1.0, STEPS, DELTA)


def test_the_bound_of_all_guesses_right_is_the_closed_form() -> None:
    """With delta 0, r right guesses of r refute eps while q^r < 0.05, q = e^eps/(1+e^eps)."""
    q = 0.05 ** (1 / 100)
    assert epsilon_lower_bound(1000, 100, 100) == pytest.approx(math.log(q / (1 - q)), 1e-6)
    assert p_value(1000, 100, 100, 3.0, 0.0) == pytest.approx((1 / (1 + math.exp(-3))) ** 100)
    assert epsilon_lower_bound(1000, 100, 50) == 0.0
    # delta only weakens the bound.
    assert epsilon_lower_bound(1000, 100, 95, 1e-5) < epsilon_lower_bound(1000, 100, 95)


def test_guesses_are_the_top_and_bottom_scores() -> None:
    scores = np.array([5.0, -1.0, 3.0, 0.0, -4.0, 2.0])
    included = np.array([True, False, False, True, False, True])
    result = audit_scores(scores, included, guesses_per_side=2)
    # "in": scores 5 (in) and 3 (out); "out": -4 (out) and -1 (out).
    assert (result.guesses, result.correct) == (4, 3)


def test_the_private_step_stays_below_the_accountant() -> None:
    result = dirac_canary_audit(CANARIES, SIGMA, STEPS, PER_SIDE, delta=DELTA)
    assert result.guesses == 2 * PER_SIDE
    assert 0 < result.epsilon_lower_bound < accountant_epsilon(), result


def test_the_secure_noise_stays_below_the_accountant() -> None:
    result = dirac_canary_audit(CANARIES, SIGMA, STEPS, PER_SIDE, delta=DELTA, secure_noise=True)
    assert result.epsilon_lower_bound < accountant_epsilon(), result


def test_without_noise_the_audit_refutes_the_accountant() -> None:
    result = dirac_canary_audit(CANARIES, 0.0, STEPS, PER_SIDE, delta=DELTA)
    assert result.correct == result.guesses
    assert result.epsilon_lower_bound > accountant_epsilon() + 1, result


def test_without_clipping_the_audit_refutes_the_accountant() -> None:
    """Canaries of norm 100 C, the clipping weights forced to 1: the noise of the claimed
    sigma no longer hides them."""
    with clipping_off():
        result = dirac_canary_audit(
            CANARIES, SIGMA, STEPS, PER_SIDE, canary_norm=100.0, delta=DELTA
        )
    assert result.epsilon_lower_bound > accountant_epsilon() + 1, result
    # The same canaries, clipped: below again.
    clipped = dirac_canary_audit(CANARIES, SIGMA, STEPS, PER_SIDE, canary_norm=100.0, delta=DELTA)
    assert clipped.epsilon_lower_bound < accountant_epsilon(), clipped
