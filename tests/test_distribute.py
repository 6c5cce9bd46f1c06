"""tf.distribute: two replicas give exactly the one-device log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import keras_gradtrack as kgt

rng = np.random.default_rng(21)
REGULARIZER = keras.regularizers.L2(0.05)


def build() -> Any:
    inputs = keras.Input((10,), name="pixels")
    hidden = keras.layers.Dense(12, activation="relu", kernel_regularizer=REGULARIZER)(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_mirrored_strategy_on_two_cpus_logs_what_one_device_logs(tmp_path: Path) -> None:
    x = rng.normal(size=(40, 10)).astype("float32")
    y = rng.integers(0, 3, 40)
    ids = np.arange(100, 140)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
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
