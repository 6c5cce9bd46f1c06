"""Tracking under `keras.distribution.DataParallel` on JAX: the log one device writes.

Each fit runs in a process of its own (`distribution_worker.py`), where JAX starts
with four virtual CPU devices: once under `DataParallel` over the four, once on one
device without a distribution, with the same weights, data and seeds. The two logs
must hold the same rows (ids, steps, epochs, every per-example and per-step column)
and the fits the same final weights: XLA computes the sharded step's statistics with
the global batch's meaning. Other distributions are refused before any weight changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt
from keras_gradtrack.backends.jax import distribution as distribution_module

WORKER = Path(__file__).with_name("distribution_worker.py")
DEVICES = 4
MODELS = ("mlp", "sequence")
RTOL, ATOL = 1e-5, 1e-6  # ATOL for cosines near zero (float32 sums in another order)


def run_worker(devices: int, out: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
        "KERAS_BACKEND": "jax",
        "PYTHONPATH": os.pathsep.join([str(Path(kgt.__file__).parents[1]), *sys.path]),
    }
    done = subprocess.run(
        [sys.executable, str(WORKER), str(devices), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, Any]]]:
    outs = {devices: tmp_path_factory.mktemp(f"devices{devices}") for devices in (DEVICES, 1)}
    with ThreadPoolExecutor(2) as pool:
        reports = dict(zip(outs, pool.map(run_worker, outs, outs.values())))
    return {devices: (outs[devices], reports[devices]) for devices in outs}


@pytest.mark.parametrize("model", MODELS)
def test_data_parallel_log_is_the_one_device_log(runs: Any, model: str) -> None:
    (sharded_out, sharded), (single_out, single) = runs[DEVICES], runs[1]
    assert sharded[model]["weight_devices"] == DEVICES
    assert single[model]["weight_devices"] == 1
    # The example-independence guard ran once, not once per device.
    assert sharded[model]["guard_runs"] == single[model]["guard_runs"] == 1

    sharded_log = kgt.GradientLog(sharded_out / model / "log.h5")
    single_log = kgt.GradientLog(single_out / model / "log.h5")
    assert sharded_log.per_example_names == single_log.per_example_names
    assert sharded_log.per_step_names == single_log.per_step_names
    assert sharded_log.num_examples == single_log.num_examples == 2 * 72
    assert sharded_log.per_step("batch_size").tolist() == [16, 16, 16, 16, 8] * 2
    for name in ("example_id", "step", "epoch"):
        assert sharded_log.per_example(name).tolist() == single_log.per_example(name).tolist()
    for name in sharded_log.per_example_names:
        np.testing.assert_allclose(
            sharded_log.per_example(name), single_log.per_example(name), RTOL, ATOL, err_msg=name
        )
    for name in sharded_log.per_step_names:
        np.testing.assert_allclose(
            sharded_log.per_step(name), single_log.per_step(name), RTOL, ATOL, err_msg=name
        )

    # The final weights, and gradient_statistics on one batch after the fit.
    sharded_arrays = np.load(sharded_out / model / "arrays.npz")
    single_arrays = np.load(single_out / model / "arrays.npz")
    assert sorted(sharded_arrays) == sorted(single_arrays)
    for name in sharded_arrays:
        np.testing.assert_allclose(
            sharded_arrays[name], single_arrays[name], RTOL, ATOL, err_msg=name
        )


def test_a_last_batch_the_devices_do_not_divide_fails_as_in_plain_keras(runs: Any) -> None:
    # Keras' DataParallel neither pads nor drops it: placing the batch fails.
    report = runs[DEVICES][1]["mlp"]
    assert report["plain_ragged"].startswith("IndivisibleError")
    assert report["tracked_ragged"] == report["plain_ragged"]


def test_model_parallel_is_refused_before_any_weight_changes(tmp_path: Path) -> None:
    mesh = keras.distribution.DeviceMesh((1,), ["model"], jax.devices()[:1])
    distribution = keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh))
    keras.distribution.set_distribution(distribution)
    try:
        inputs = keras.Input((4,))
        model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        before = [np.asarray(w) for w in model.get_weights()]
        x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
        logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
        with pytest.raises(NotImplementedError, match=r"ModelParallel.*DataParallel"):
            model.fit(x, y, batch_size=4, verbose=0, callbacks=[logger])
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)
    finally:
        keras.distribution.set_distribution(None)


def test_data_parallel_over_several_processes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:1]))
    try:
        monkeypatch.setattr(distribution_module.jax, "process_count", lambda: 2)
        with pytest.raises(NotImplementedError, match=r"one process.*process_count\(\) == 2"):
            distribution_module.refuse_untracked_distribution()
    finally:
        keras.distribution.set_distribution(None)
