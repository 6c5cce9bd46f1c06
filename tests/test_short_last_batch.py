"""Several epochs with a short last batch: every step's rows in the log, oracle-exact
(tests/short_last_batch.py; the same runs on JAX in
tests/jax_backend/test_jax_short_last_batch.py)."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
from oracle import assert_matches_oracle, oracle_statistics
from short_last_batch import assert_every_step_is_logged_oracle_exact

import keras_gradtrack as kgt


@pytest.mark.parametrize("flush_seconds", [1.0, None])
def test_every_step_of_every_epoch_is_logged_oracle_exact(
    tmp_path: Path, flush_seconds: float | None
) -> None:
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    assert_every_step_is_logged_oracle_exact(
        model, tmp_path / "run.h5", flush_seconds, oracle_statistics, assert_matches_oracle
    )
