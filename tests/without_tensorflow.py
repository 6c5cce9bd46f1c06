"""Runs a script in a fresh process of this test's backend (JAX, PyTorch) where any
import of TensorFlow fails, as on a GPU machine without it. The script starts with a compiled Dense model (`model`), `np`,
`keras` and `kgt` in scope; `sys.argv[1]` is the log's path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import patience

ROOT = Path(__file__).resolve().parents[1]

PREAMBLE = """
import importlib.abc, importlib.machinery, sys

class NoTensorFlow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Found (so that a probe such as torch's `find_spec` sees no file of it), not loaded.
    def find_spec(self, name, path, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        raise ImportError(f"TensorFlow is not installed here: {spec.name}")

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, NoTensorFlow())
import keras, numpy as np
import keras_gradtrack as kgt
inputs = keras.Input((4,))
model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
model.compile(optimizer="sgd", loss="mse")
"""


def run_without_tensorflow(body: str, path: Path) -> None:
    """Runs `PREAMBLE` then `body` with `path` as `sys.argv[1]`; fails with its stderr."""
    env = {
        "KERAS_BACKEND": keras.backend.backend(),
        "PYTHONPATH": str(ROOT),
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-c", PREAMBLE + textwrap.dedent(body), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience.seconds(2),
    )
    assert result.returncode == 0, result.stderr[-3000:]
