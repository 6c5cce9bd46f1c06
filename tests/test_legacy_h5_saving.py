"""A legacy `.h5` model file round-trips through `keras.models.load_model`."""

from pathlib import Path

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt


def functional() -> keras.Model:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="relu")(inputs)
    return kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))


def sequential() -> keras.Model:
    return kgt.GradientTrackingSequential([keras.Input((4,)), keras.layers.Dense(2)])


@pytest.mark.parametrize("build", [functional, sequential])
def test_h5_save_loads_with_equal_weights_and_predictions(tmp_path: Path, build) -> None:
    keras.utils.set_random_seed(0)
    model = build()
    # A loss object: Keras itself cannot load a legacy file compiled with loss="mse".
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())
    model.save(tmp_path / "model.h5")
    loaded = keras.models.load_model(tmp_path / "model.h5")
    assert isinstance(loaded, type(model))
    assert [v.shape for v in loaded.weights] == [v.shape for v in model.weights]
    for saved, restored in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(restored, saved)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
