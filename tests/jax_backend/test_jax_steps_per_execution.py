"""`steps_per_execution > 1` on JAX: every step's rows logged, as with one step per call
(tests/steps_per_execution.py).

Keras' JAX trainer runs a call's steps one after another, each its own jitted step;
the tracked train function does the same, each step tracked or not as the loggers
ask, so the log equals that of one step per call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from steps_per_execution import assert_equals_one_step_per_call


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("every_n_steps", [1, 3])
def test_rows_weights_and_logs_equal_those_of_one_step_per_call(
    tmp_path: Path, steps: int, every_n_steps: int
) -> None:
    assert_equals_one_step_per_call(tmp_path, steps, every_n_steps=every_n_steps)
