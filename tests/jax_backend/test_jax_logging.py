"""The HDF5 log on JAX: the same schema as on TensorFlow, and the backend that wrote it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import patience
import pytest
from backend_models import compiled, mlp
from without_tensorflow import run_without_tensorflow

import keras_gradtrack as kgt
from keras_gradtrack import statistics
from keras_gradtrack.backends.jax import mixin
from keras_gradtrack.statistics import DEFAULT_STATISTICS

ROOT = Path(__file__).resolve().parents[2]


def test_the_logger_writes_the_schema_and_names_the_backend(tmp_path: Path) -> None:
    model = compiled(mlp(kgt.GradientTrackingModel))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 12)).astype("float32"), rng.integers(0, 3, 40)
    ids = np.arange(40, dtype=np.int64) + 2**40
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, every_n_steps=2)
    model.fit({"x": x, "example_id": ids}, y, batch_size=8, epochs=2, verbose=0, callbacks=[logger])
    with h5py.File(path, "r") as f:
        assert f.attrs["backend"] == "jax"
        assert f.attrs["schema_version"] == 2
        assert list(f["layers"].attrs["names"]) == model.tracked_layer_names
        assert f["per_example/example_id"].dtype == np.int64
        # Every second of the ten steps (two epochs of five): 5 tracked steps of 8.
        assert f["per_example/cosine"].shape == (40,)
        assert f["per_example/layer_grad_norm"].shape == (40, 3)
        assert set(f["per_example/example_id"][:]) <= set(ids)
        assert f["per_step/step"][:].tolist() == [0, 2, 4, 6, 8]
        for name in DEFAULT_STATISTICS:
            group = "per_example" if name in f["per_example"] else "per_step"
            assert name in f[group], name
    log = kgt.GradientLog(path)
    assert np.all(np.isfinite(log.per_example("cosine")))


def test_a_tracked_fit_check_and_autodiff_import_no_tensorflow() -> None:
    script = textwrap.dedent(
        """
        import sys
        import keras, numpy as np
        import keras_gradtrack as kgt
        from keras_gradtrack import statistics
        inputs = keras.Input((4,))
        model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        reports = []
        model.gradient_tracking.subscribe("k", statistics.resolve(None), 1, reports.append)
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
        assert reports[0].values["cosine"].shape == (8,)
        x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
        assert kgt.check(model, x=x, y=y).refusals == []
        assert kgt.autodiff.batch_jacobian(model, x).shape == (8, 2, 4)
        assert "tensorflow" not in sys.modules, "tensorflow was imported"
        """
    )
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience.seconds(2),
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_loggers_and_the_log_need_no_tensorflow(tmp_path: Path) -> None:
    # As on a GPU machine without TensorFlow: any import of it fails.
    body = """
        path = sys.argv[1]
        x = np.ones((8, 4), "float32")
        features = kgt.OutputGradientLogger(path + ".features.h5", x[:2], every_n_steps=1)
        model.fit(
            x, np.ones((8, 2), "float32"), batch_size=4, verbose=0,
            callbacks=[kgt.HDF5GradientLogger(path), features],
        )
        log = kgt.GradientLog(path)
        assert log.per_example("cosine").shape == (8,), log.per_example("cosine").shape
        """
    run_without_tensorflow(body, tmp_path / "run.h5")
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert f.attrs["backend"] == "jax"
        assert f["per_step/step"][:].tolist() == [0, 1]
    with h5py.File(tmp_path / "run.h5.features.h5", "r") as f:  # OutputGradientLogger's
        assert f["per_step/output_grad_norm"].shape == (2, 2, 1)


def test_keras_runs_on_jax_here() -> None:
    assert keras.backend.backend() == "jax"


def test_the_rows_stay_on_the_device_until_their_block_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[int] = []
    unpacked = mixin.unpacked

    def counted(*args: Any) -> Any:
        copies.append(1)
        return unpacked(*args)

    monkeypatch.setattr(mixin, "unpacked", counted)
    copied_by_step: list[int] = []

    class Copies(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            copied_by_step.append(len(copies))

    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(48, 12)).astype("float32"), rng.integers(0, 3, 48)
    keras.utils.set_random_seed(3)
    model = compiled(mlp(kgt.GradientTrackingModel))
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", flush_every=4, flush_seconds=None)
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[logger, Copies()])
    # The first step's rows are read (checked) at once; the next ones stay on the device
    # until their block is written (steps 0-3 after step 3, on the writer's thread).
    assert copied_by_step[:3] == [1, 1, 1]
    assert len(copies) == 6
    # The same rows as read after each step.
    keras.utils.set_random_seed(3)
    again = compiled(mlp(kgt.GradientTrackingModel))
    reports: list[Any] = []
    again.gradient_tracking.subscribe("k", statistics.resolve(None), 1, reports.append)
    again.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    log = kgt.GradientLog(tmp_path / "run.h5")
    for name in ("loss", "grad_norm", "cosine", "layer_grad_norm"):
        read = np.concatenate([np.asarray(report.values[name]) for report in reports])
        np.testing.assert_allclose(log.per_example(name), read, rtol=1e-6, err_msg=name)
    rates = [float(report.values["learning_rate"]) for report in reports]
    np.testing.assert_allclose(log.per_step("learning_rate"), rates, rtol=1e-6)
