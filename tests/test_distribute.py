"""tf.distribute: two replicas give exactly the one-device log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest
import tensorflow as tf

import keras_gradtrack as kgt

rng = np.random.default_rng(21)
REGULARIZER = keras.regularizers.L2(0.05)


def build() -> Any:
    inputs = keras.Input((10,), name="pixels")
    hidden = keras.layers.Dense(12, activation="relu", kernel_regularizer=REGULARIZER)(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    # Wide enough that one device takes its dots from the Gram matrix on small
    # batches: with two replicas the batch gradient is not the local sum.
    hidden = keras.layers.Dense(32, activation="tanh")(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_mirrored_strategy_on_two_cpus_logs_what_one_device_logs(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    x = rng.normal(size=(40, 10)).astype("float32")
    y = rng.integers(0, 3, 40)
    ids = np.arange(100, 140)
    strategy = two_cpu_strategy
    with strategy.scope():
        distributed = build()
    single = build()
    single.set_weights(distributed.get_weights())
    for model, name in ((single, "single.h5"), (distributed, "mirrored.h5")):
        model.fit(
            {"pixels": x, "example_id": ids},
            y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[kgt.HDF5GradientLogger(tmp_path / name)],
        )
    for expected, actual in zip(single.get_weights(), distributed.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    with (
        kgt.GradientLog(tmp_path / "single.h5") as one,
        kgt.GradientLog(tmp_path / "mirrored.h5") as two,
    ):
        assert two.num_examples == one.num_examples == 80  # one row per example of the global batch
        np.testing.assert_array_equal(two.per_example("example_id"), one.per_example("example_id"))
        np.testing.assert_array_equal(two.per_step("batch_size"), [16, 16, 8, 16, 16, 8])
        for name in one.per_example_names:
            np.testing.assert_allclose(
                two.per_example(name), one.per_example(name), rtol=1e-4, atol=1e-6, err_msg=name
            )
        for name in one.per_step_names:
            np.testing.assert_allclose(
                two.per_step(name), one.per_step(name), rtol=1e-4, err_msg=name
            )


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_with_two_processes(tmp_path: Path) -> None:
    """Two workers on 127.0.0.1: only the chief writes, every example appears once per epoch."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    worker_script = Path(__file__).with_name("multiworker_worker.py")
    processes = []
    for index in range(2):
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            ),
        }
        path = tmp_path / f"worker{index}" / "run.h5"
        path.parent.mkdir()
        processes.append(
            subprocess.Popen(
                [sys.executable, str(worker_script), str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [process.communicate(timeout=patience.seconds(4))[0] for process in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    assert not (tmp_path / "worker1" / "run.h5").exists()
    with kgt.GradientLog(tmp_path / "worker0" / "run.h5") as log:
        ids = log.per_example("example_id")
        epochs = log.per_example("epoch")
        first_fit = log.per_example("step") < 6
        for epoch in (0, 1):
            assert sorted(ids[first_fit & (epochs == epoch)].tolist()) == list(range(48))
        # The appended fit tracked its steps 0 and 4, numbered on after the file's last.
        assert log.per_step("step").tolist() == [0, 1, 2, 3, 4, 5, 6, 10]
        assert log.per_step("batch_size").tolist() == [16] * 8
        assert np.all(np.isfinite(log.per_example("cosine")))
