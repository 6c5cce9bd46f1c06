"""Keras on a backend this library does not track yet (PyTorch): the model classes are
refused by name with what to do, before any model exists; a log written on TensorFlow
reads there as anywhere (`GradientLog` needs no backend)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("torch")  # `make test` installs it (the `dev` extra)

SCRIPT = """
import sys
import keras
import keras_gradtrack as kgt

assert keras.backend.backend() == "torch"
for name in ("GradientTrackingModel", "GradientTrackingSequential", "GradientTrackingMixin"):
    try:
        getattr(kgt, name)
    except NotImplementedError as error:
        print(name, "refused:", error)
    else:
        raise SystemExit(name + " was not refused")
log = kgt.GradientLog(sys.argv[1])
print("rows", log.num_examples, "tensorflow imported", "tensorflow" in sys.modules)
"""


def test_the_torch_backend_is_refused_by_name_and_reads_logs(tmp_path: Path) -> None:
    model = kgt.GradientTrackingSequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    path = tmp_path / "run.h5"
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    environment = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len([line for line in lines if "refused:" in line]) == 3
    assert "the torch backend is not tracked yet" in lines[0]
    assert "KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax" in lines[0]
    assert lines[-1] == "rows 4 tensorflow imported False"
