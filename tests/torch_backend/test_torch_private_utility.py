"""The PyTorch route of `benchmarks/private_utility.py`: its keras_gradtrack driver
(`benchmarks/peers_utility/kgt_digits.py`) trains the digits task through the
PyTorch engine's private step, here for two Poisson batches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from keras_gradtrack.privacy import compute_epsilon

DRIVERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers_utility"


def test_the_keras_gradtrack_driver_trains_privately_on_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(DRIVERS))
    try:
        import kgt_digits
        import utility_task

        # Two steps of one epoch.
        monkeypatch.setattr(utility_task, "STEPS_PER_EPOCH", 2)
        args = argparse.Namespace(epochs=1, learning_rate=0.5, noise_multiplier=1.1)
        row = kgt_digits.run(0, args)
    finally:
        for name in ("kgt_digits", "utility_task"):
            sys.modules.pop(name, None)
    assert row["tool"] == "keras_gradtrack_torch"
    assert row["steps"] == 2
    rate = utility_task.SAMPLING_RATE
    assert row["epsilon"] == pytest.approx(compute_epsilon(1.1, rate, 2, utility_task.DELTA))
    assert 0.0 <= row["accuracy"] <= 1.0
