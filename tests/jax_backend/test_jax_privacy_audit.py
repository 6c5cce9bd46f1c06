"""The one-run audit (Steinke, Nasr, Jagielski 2023) of the JAX engine's private step,
as `tests/test_privacy_audit.py` audits TensorFlow's: Dirac canaries through
`make_private`'s real step stay below the accountant's epsilon, and the noise or the
clipping taken out (`clipping_off`, the seam both engines share) is refuted."""

from __future__ import annotations

import pytest

from keras_gradtrack.privacy import compute_epsilon
from keras_gradtrack.privacy_audit import clipping_off, dirac_canary_audit

# 1000 canaries, 4 full-batch steps at sigma 3: the accountant says epsilon 2.98 at
# delta 1e-5; 100 guesses each side, all right, would refute up to 4.17.
CANARIES, SIGMA, STEPS, PER_SIDE, DELTA = 1000, 3.0, 4, 100, 1e-5


def accountant_epsilon() -> float:
    return compute_epsilon(SIGMA, 1.0, STEPS, DELTA)


@pytest.mark.parametrize("secure_noise", [False, True], ids=["default_noise", "secure_noise"])
def test_the_private_step_stays_below_the_accountant(secure_noise: bool) -> None:
    result = dirac_canary_audit(
        CANARIES, SIGMA, STEPS, PER_SIDE, delta=DELTA, secure_noise=secure_noise
    )
    assert result.guesses == 2 * PER_SIDE
    assert 0 < result.epsilon_lower_bound < accountant_epsilon(), result


def test_without_noise_the_audit_refutes_the_accountant() -> None:
    result = dirac_canary_audit(CANARIES, 0.0, STEPS, PER_SIDE, delta=DELTA)
    assert result.correct == result.guesses
    assert result.epsilon_lower_bound > accountant_epsilon() + 1, result


def test_without_clipping_the_audit_refutes_the_accountant() -> None:
    """Canaries of norm 100 C, the clipping weights forced to 1 in the JAX step: the
    noise of the claimed sigma no longer hides them."""
    with clipping_off():
        result = dirac_canary_audit(
            CANARIES, SIGMA, STEPS, PER_SIDE, canary_norm=100.0, delta=DELTA
        )
    assert result.epsilon_lower_bound > accountant_epsilon() + 1, result
    # The same canaries, clipped: below again.
    clipped = dirac_canary_audit(CANARIES, SIGMA, STEPS, PER_SIDE, canary_norm=100.0, delta=DELTA)
    assert clipped.epsilon_lower_bound < accountant_epsilon(), clipped
