"""Several epochs with a short last batch on JAX: every step's rows in the log
(tests/short_last_batch.py).

The full batches and the short last one are two traces of the tracked step, each
with its own payload layout; every step's rows are read with its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_models import mlp
from jax_oracle import assert_matches_oracle, oracle_statistics
from short_last_batch import assert_every_step_is_logged_oracle_exact

import keras_gradtrack as kgt


@pytest.mark.parametrize("flush_seconds", [1.0, None])
def test_every_step_of_every_epoch_is_logged_oracle_exact(
    tmp_path: Path, flush_seconds: float | None
) -> None:
    assert_every_step_is_logged_oracle_exact(
        mlp(kgt.GradientTrackingModel),
        tmp_path / "run.h5",
        flush_seconds,
        oracle_statistics,
        assert_matches_oracle,
    )
