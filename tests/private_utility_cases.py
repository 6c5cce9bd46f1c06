"""The JAX and PyTorch routes of `benchmarks/private_utility.py`: its keras_gradtrack
driver (`benchmarks/peers_utility/kgt_digits.py`) trains the digits task through the
backend's private step, here for two Poisson batches; each backend's test module
imports this case."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import keras
import pytest

from keras_gradtrack.privacy import compute_epsilon

DRIVERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers_utility"


def test_the_keras_gradtrack_driver_trains_privately(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(DRIVERS))
    try:
        import kgt_digits
        import utility_task

        # Two steps of one epoch (on JAX each Poisson batch size is one more compilation).
        monkeypatch.setattr(utility_task, "STEPS_PER_EPOCH", 2)
        args = argparse.Namespace(epochs=1, learning_rate=0.5, noise_multiplier=1.1)
        row = kgt_digits.run(0, args)
    finally:
        for name in ("kgt_digits", "utility_task"):
            sys.modules.pop(name, None)
    assert row["tool"] == f"keras_gradtrack_{keras.backend.backend()}"
    assert row["steps"] == 2
    rate = utility_task.SAMPLING_RATE
    assert row["epsilon"] == pytest.approx(compute_epsilon(1.1, rate, 2, utility_task.DELTA))
    assert 0.0 <= row["accuracy"] <= 1.0
