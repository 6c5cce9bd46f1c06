"""The same model, weights and data give the same attribution log on TensorFlow, JAX and
PyTorch:
the same products with the targets' gradients and, from the same `sketch_seed`, the same
gradient sketches (the projections are defined once, `projection_matrices`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import patience
import pytest

import keras_gradtrack as kgt

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("jax")
pytest.importorskip("torch")

# Fits a small CNN from weights drawn by numpy, on either backend, logging targets and
# sketches to the path given.
SCRIPT = textwrap.dedent(
    """
    import sys
    import keras, numpy as np
    import keras_gradtrack as kgt

    inputs = keras.Input((6, 6, 1))
    hidden = keras.layers.Conv2D(3, 3, activation="relu")(inputs)
    hidden = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(hidden))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(11)
    model.set_weights([0.5 * rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    x = rng.normal(size=(16, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 3, 16)
    targets = (rng.normal(size=(3, 6, 6, 1)).astype("float32"), rng.integers(0, 3, 3))
    logger = kgt.HDF5GradientLogger(sys.argv[1], targets=targets, sketch_dim=2, sketch_seed=5)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    """
)


def test_both_backends_write_the_same_products_and_sketches(tmp_path: Path) -> None:
    paths = {}
    for backend in ("tensorflow", "jax", "torch"):
        paths[backend] = tmp_path / f"{backend}.h5"
        env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(paths[backend])],
            env=env,
            capture_output=True,
            text=True,
            timeout=patience.seconds(imports=2),
        )
        assert result.returncode == 0, result.stderr[-3000:]
    logs = {backend: kgt.GradientLog(path) for backend, path in paths.items()}
    try:
        for backend in ("jax", "torch"):
            assert logs[backend].attrs["backend"] == backend
            assert logs[backend].layout.sketch.widths == logs["tensorflow"].layout.sketch.widths
            for name in ("loss", "target_influence", "gradient_sketch"):
                found, expected = (logs[b].per_example(name) for b in (backend, "tensorflow"))
                scale = np.abs(expected).max()
                np.testing.assert_allclose(
                    found, expected, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{backend} {name}"
                )
    finally:
        for log in logs.values():
            log.close()
