"""A tracked layer the model's forward pass does not call, on every engine (TensorFlow,
JAX, PyTorch; each backend's test module imports these): refused naming it, before any
weight changes, in `fit` and in `gradient_statistics`."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

X = np.random.default_rng(4).normal(size=(6, 5)).astype("float32")
Y = np.zeros((6, 3), "float32")


class UnusedLayer(kgt.GradientTrackingModel):
    """A subclassed model that builds a layer its `call` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.used = keras.layers.Dense(3, name="used")
        self.unused = keras.layers.Dense(3, name="unused")

    def build(self, input_shape: Any) -> None:
        self.used.build(input_shape)
        self.unused.build(input_shape)

    def call(self, x: Any) -> Any:
        return self.used(x)


def built() -> Any:
    model = UnusedLayer()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model(X[:1])
    return model


def test_gradient_statistics_refuse_an_uncalled_layer_naming_it() -> None:
    with pytest.raises(ValueError, match=r"did not call the tracked layers \['unused'\]"):
        built().gradient_statistics(X, Y)


def test_a_tracked_fit_refuses_an_uncalled_layer_before_any_weight_changes() -> None:
    model = built()
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    model.gradient_tracking.subscribe("test", kgt.statistics.resolve(None), 1, lambda report: None)
    with pytest.raises(ValueError, match=r"did not call the tracked layers \['unused'\]"):
        model.fit(X, Y, batch_size=3, verbose=0)
    for kept, now in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(kept, keras.ops.convert_to_numpy(now))
