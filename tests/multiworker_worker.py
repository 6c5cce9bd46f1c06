"""One worker of the MultiWorkerMirroredStrategy test (run as a subprocess with TF_CONFIG)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_gradtrack as kgt


def main(path: str) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 8)).astype("float32")
    y = rng.integers(0, 3, 48)
    with strategy.scope():
        inputs = keras.Input((8,), name="pixels")
        hidden = keras.layers.Dense(6, activation="relu")(inputs)
        model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
        model.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    dataset = tf.data.Dataset.from_tensor_slices(({"pixels": x, "example_id": np.arange(48)}, y))
    model.fit(
        dataset.batch(16),
        epochs=2,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path)],
    )
    # A second fit appends to the chief's file, which already holds 6 steps: every worker
    # must still track the same steps (the model's count, not the file's, decides).
    model.fit(
        dataset.batch(16),
        epochs=2,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path, append=True, every_n_steps=4)],
    )
    print("worker done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
