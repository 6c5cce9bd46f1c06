"""Tracking under `keras.distribution` on JAX: the log one device writes.

Each mode's fits run in a process of their own (`distribution_worker.py`), where JAX
starts with four virtual CPU devices: under `DataParallel` over the four, under
`ModelParallel` on a 2 x 2 mesh (weights sharded), and on one device without a
distribution, with the same weights, data and seeds; and in two processes of two
devices each (`keras.distribution.initialize`, collectives over gloo), one
`DataParallel` over the four, each process fitting on its own rows of every global
batch. The logs must hold the same rows (ids, steps, epochs, every per-example and
per-step column) and the fits the same final weights: XLA computes the sharded step's
statistics with the global batch's meaning. So must a private fit with adaptive
clipping (its bounds and weights). Distribution classes of one's own are refused.
"""

from __future__ import annotations

import json
import os
import socket
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
DISTRIBUTED = ("data_parallel", "model_parallel", "processes")
RTOL, ATOL = 1e-5, 1e-6  # ATOL for cosines near zero (float32 sums in another order)


def worker_env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "KERAS_BACKEND": "jax",
        "PYTHONPATH": os.pathsep.join([str(Path(kgt.__file__).parents[1]), *sys.path]),
    }


def run_worker(mode: str, out: Path) -> dict[str, Any]:
    if mode == "processes":
        return run_processes(out)
    done = subprocess.run(
        [sys.executable, str(WORKER), mode, str(out)],
        env=worker_env(DEVICES),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_processes(out: Path) -> dict[str, Any]:
    """Two processes of two devices each, one `DataParallel` over the four: the first
    process's report (the first process writes the log)."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        address = f"localhost:{probe.getsockname()[1]}"
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "processes", str(out), f"{address}/{index}"],
            env=worker_env(DEVICES // 2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    try:
        done = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for worker, (_, stderr) in zip(workers, done):
        assert worker.returncode == 0, stderr[-4000:]
    reports = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in done]
    assert reports[0] == reports[1]  # every process saw the same bounds and weights
    return reports[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in (*DISTRIBUTED, "one_device")}
    with ThreadPoolExecutor(len(outs)) as pool:
        reports = dict(zip(outs, pool.map(run_worker, outs, outs.values())))
    return {mode: (outs[mode], reports[mode]) for mode in outs}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", DISTRIBUTED)
def test_distributed_log_is_the_one_device_log(runs: Any, mode: str, model: str) -> None:
    (sharded_out, sharded), (single_out, single) = runs[mode], runs["one_device"]
    assert sharded[model]["weight_devices"] == DEVICES
    assert sharded[model]["weight_sharded"] == (mode == "model_parallel")
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


@pytest.mark.parametrize("mode", DISTRIBUTED)
def test_adaptive_clipping_counts_the_global_batch(runs: Any, mode: str) -> None:
    """A private fit with adaptive clipping: the same bounds and weights as on one device."""
    sharded, single = runs[mode][1]["mlp"]["adaptive"], runs["one_device"][1]["mlp"]["adaptive"]
    np.testing.assert_allclose(sharded["bounds"], single["bounds"], RTOL)
    assert sharded["bound"] == pytest.approx(single["bound"], rel=RTOL)
    assert single["bound"] != pytest.approx(0.5)  # the bound moved
    for found, expected in zip(sharded["weights"], single["weights"]):
        np.testing.assert_allclose(found, expected, RTOL, ATOL)


def test_a_last_batch_the_devices_do_not_divide_fails_as_in_plain_keras(runs: Any) -> None:
    # Keras' DataParallel neither pads nor drops it: placing the batch fails.
    report = runs["data_parallel"][1]["mlp"]
    assert report["plain_ragged"].startswith("IndivisibleError")
    assert report["tracked_ragged"] == report["plain_ragged"]


def test_a_distribution_class_of_ones_own_is_refused() -> None:
    base = keras.distribution.DataParallel.__mro__[1]  # Keras' Distribution

    class Custom(base):  # type: ignore[misc, valid-type]
        def get_data_layout(self, data_shape: Any) -> None:
            return None

        def get_variable_layout(self, variable: Any) -> None:
            return None

        def get_tensor_layout(self, path: Any) -> None:
            return None

        def distribute_dataset(self, dataset: Any) -> Any:
            return dataset

    mesh = keras.distribution.DeviceMesh((1,), ["batch"], jax.devices()[:1])
    keras.distribution.set_distribution(Custom(mesh))
    try:
        with pytest.raises(NotImplementedError, match=r"Custom.*DataParallel and ModelParallel"):
            distribution_module.refuse_untracked_distribution()
    finally:
        keras.distribution.set_distribution(None)
