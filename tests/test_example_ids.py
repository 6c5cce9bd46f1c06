"""Example ids reach the log exactly as int64, or are refused before training says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt
from keras_gradtrack.engine import distribute

rng = np.random.default_rng(8)
X = rng.normal(size=(100, 3)).astype("float32")
Y = rng.normal(size=(100, 2)).astype("float32")
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
IDS = {
    # Above 2**53 float64 rounds to even numbers: 100 ids became 51.
    "from_2**53": 2**53 + np.arange(100),
    # Above 2**60 neighbours round to one value.
    "from_2**60": 2**60 + np.arange(100),
    # Hashed ids span all of int64, both ends included.
    "hashed": np.concatenate(
        [[INT64_MAX, INT64_MIN, -1, 0], rng.integers(INT64_MIN, INT64_MAX, 96, dtype=np.int64)]
    ),
}


def small_model() -> Any:
    inputs = keras.Input((3,), name="x")
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def logged_ids(path: Path) -> np.ndarray:
    with kgt.GradientLog(path) as log:
        return log.per_example("example_id")


@pytest.mark.parametrize("ids", list(IDS.values()), ids=list(IDS))
@pytest.mark.parametrize("source", ["numpy", "tf.data"])
def test_int64_ids_are_logged_exactly(tmp_path: Path, ids: np.ndarray, source: str) -> None:
    ids = ids.astype(np.int64)
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, every_n_steps=1)
    if source == "numpy":
        small_model().fit(
            {"x": X, "example_id": ids},
            Y,
            batch_size=25,
            shuffle=False,
            verbose=0,
            callbacks=[logger],
        )
    else:
        dataset = tf.data.Dataset.from_tensor_slices(({"x": X, "example_id": ids}, Y)).batch(25)
        small_model().fit(dataset, shuffle=False, verbose=0, callbacks=[logger])
    logged = logged_ids(path)
    assert logged.dtype == np.int64
    np.testing.assert_array_equal(logged, ids)


def test_ids_above_2_to_the_62_survive_the_mean_over_mirrored_replicas(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    # Keras averages a step's outputs over replicas; int64 ids from 2**62 up overflowed.
    ids = np.concatenate([[INT64_MAX, INT64_MIN], 2**62 + 2**61 + np.arange(14)])
    with two_cpu_strategy.scope():
        model = small_model()
    model.fit(
        {"x": X[:16], "example_id": ids},
        Y[:16],
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    np.testing.assert_array_equal(logged_ids(tmp_path / "run.h5"), ids)


def test_int64_halves_are_joined_exactly_after_a_multi_worker_mean(
    two_cpu_strategy: tf.distribute.MirroredStrategy,
) -> None:
    """MultiWorkerMirroredStrategy (two processes: too slow to run here) reduces a
    step's outputs with `strategy.reduce("MEAN", value, axis=0)` and returns ints as
    float64; the split halves come through that exactly."""
    ids = tf.constant([INT64_MAX, INT64_MIN, -1, 0, 2**53 + 1, -(2**62) - 3], tf.int64)
    protected = two_cpu_strategy.run(lambda: distribute.protect_from_replica_mean({"id": ids}))
    reduced = {
        name: tf.cast(two_cpu_strategy.reduce("MEAN", half, axis=0), tf.float64)
        for name, half in protected["id"].items()
    }
    joined = distribute._joined_int64({"id": reduced})["id"]
    np.testing.assert_array_equal(joined.numpy(), ids.numpy())


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([f"id{i}" for i in range(100)]), r"dtype=string.*np.unique"),
        (np.arange(100, dtype=np.uint64) + 2**63, r"dtype=uint64.*view\(np.int64\)"),
        (np.arange(100, dtype=np.float64), r"dtype=float64"),
    ],
    ids=["strings", "uint64", "float64"],
)
@pytest.mark.parametrize("source", ["numpy", "tf.data"])
def test_ids_that_are_not_exact_integers_are_refused_before_training(
    tmp_path: Path, ids: np.ndarray, match: str, source: str
) -> None:
    model = small_model()
    before = [w.copy() for w in model.get_weights()]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match=f"one integer per example.*int64.*{match}"):
        if source == "numpy":
            model.fit({"x": X, "example_id": ids}, Y, batch_size=25, verbose=0, callbacks=[logger])
        else:
            data = tf.data.Dataset.from_tensor_slices(({"x": X, "example_id": ids}, Y)).batch(25)
            model.fit(data, shuffle=False, verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
