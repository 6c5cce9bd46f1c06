"""The oracle comparisons' one tolerance rule: rounding residue passes, bugs do not."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import assert_matches_oracle

# Three examples' gradient norms in two layers; the second example's second layer
# is masked out: exactly zero in exact arithmetic, rounding residue in float32.
EXPECTED = np.array([[1.3, 0.7], [0.9, 4.5e-11], [0.4, 1.1]])


def compare(found: np.ndarray) -> None:
    assert_matches_oracle({"layer_grad_norm": found}, {"layer_grad_norm": EXPECTED})


def test_rounding_residue_of_an_exact_zero_passes() -> None:
    found = EXPECTED.copy()
    found[1, 1] = 6.8e-11
    compare(found)


def test_float32_rounding_of_every_entry_passes() -> None:
    compare(EXPECTED * (1 + 3e-7 * np.array([[1, -1], [-1, 1], [1, 1]])))


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        ((0, 0), 1.3 * (1 + 1e-3)),  # 1e-3 relative error of a value of normal size
        ((2, 1), 0.9),  # another example's value
        ((1, 1), 1e-5),  # a masked position that is not zero
        ((1, 0), 0.9 * (1 - 2e-4)),
    ],
    ids=["relative_1e-3", "another_examples_value", "masked_not_zero", "relative_2e-4"],
)
def test_a_wrong_value_fails(entry: tuple[int, int], value: float) -> None:
    found = EXPECTED.copy()
    found[entry] = value
    with pytest.raises(AssertionError, match="layer_grad_norm"):
        compare(found)


def test_a_statistic_without_finite_values_compares_exactly() -> None:
    assert_matches_oracle({"grad_norm": np.full(2, np.nan)}, {"grad_norm": np.full(2, np.nan)})
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_matches_oracle({"grad_norm": np.zeros(2)}, {"grad_norm": np.full(2, np.nan)})
