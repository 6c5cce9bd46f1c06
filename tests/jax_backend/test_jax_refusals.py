"""What the JAX engine does not do yet is refused before training, naming the backend."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt
from keras_gradtrack import statistics

X, Y = np.ones((8, 3, 4), "float32"), np.zeros(8, "int32")


def model_with(layer: keras.layers.Layer) -> keras.Model:
    inputs = keras.Input((3, 4))
    features = layer(inputs)
    if len(features.shape) > 2:
        features = keras.layers.Flatten()(features)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(features))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def fit_tracked(model: keras.Model, names: list[str] | None = None) -> None:
    model.gradient_tracking.subscribe("test", statistics.resolve(names), 1, lambda r: None)
    model.fit(X, Y, batch_size=8, verbose=0)


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (
            keras.layers.RNN([keras.layers.LSTMCell(3, dropout=0.5), keras.layers.GRUCell(2)]),
            "StackedRNNCells.*dropout in its cell",
        ),
        (keras.layers.BatchNormalization(), "BatchNormalization.*track_batch_normalization = True"),
    ],
)
def test_layers_refused_on_jax(layer: keras.layers.Layer, match: str) -> None:
    model = model_with(layer)
    before = model.get_weights()
    with pytest.raises(ValueError, match=match):
        fit_tracked(model)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_untracked_fit_is_plain_keras() -> None:
    model = model_with(keras.layers.Dense(3))
    model.fit(X, Y, batch_size=4, verbose=0)
    assert model.gradient_tracking.step == 2
