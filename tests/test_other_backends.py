"""Keras on PyTorch picks the PyTorch engine's classes, and on a backend this library does
not track (NumPy, inference only) the model classes are refused by name with what to do,
before any model exists; a log written on TensorFlow reads on either as anywhere
(`GradientLog` needs no backend)."""

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

backend = keras.backend.backend()
for name in ("GradientTrackingModel", "GradientTrackingSequential", "GradientTrackingMixin"):
    try:
        value = getattr(kgt, name)
    except NotImplementedError as error:
        print(name, "refused:", error)
    else:
        print(name, "from", value.__module__)
log = kgt.GradientLog(sys.argv[1])
print("rows", log.num_examples, "tensorflow imported", "tensorflow" in sys.modules)
"""


def run(backend: str, path: Path) -> list[str]:
    environment = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_torch_has_its_engine_and_an_untracked_backend_is_refused(tmp_path: Path) -> None:
    model = kgt.GradientTrackingSequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    path = tmp_path / "run.h5"
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    torch_lines = run("torch", path)
    assert all("keras_gradtrack.backends.torch" in line for line in torch_lines[:3]), torch_lines
    assert torch_lines[-1] == "rows 4 tensorflow imported False"
    numpy_lines = run("numpy", path)
    assert len([line for line in numpy_lines if "refused:" in line]) == 3
    assert "TensorFlow, JAX and PyTorch backends" in numpy_lines[0]
    assert "the numpy backend is not tracked" in numpy_lines[0]
    assert numpy_lines[-1] == "rows 4 tensorflow imported False"
