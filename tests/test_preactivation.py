"""`marked_preactivation_call`: how both engines reach a layer's pre-activation output."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

from keras_gradtrack.engine.preactivation import marked_preactivation_call


class TwiceActivated(keras.layers.Dense):
    """A Dense whose `call` applies its activation twice: no one pre-activation output."""

    def call(self, inputs: Any) -> Any:
        return self.activation(self.activation(keras.ops.matmul(inputs, self.kernel)))


def test_the_mark_applies_before_the_activation_and_z_is_returned() -> None:
    layer = keras.layers.Dense(3, activation="relu", use_bias=False)
    x = np.random.default_rng(0).normal(size=(4, 2)).astype("float32")
    layer.build(x.shape)
    activation = layer.activation
    outputs, z = marked_preactivation_call(layer, layer.call, (x,), {}, lambda z: z - 1.0, "x.")
    expected_z = x @ keras.ops.convert_to_numpy(layer.kernel)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(z), expected_z, rtol=1e-6)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(outputs), np.maximum(expected_z - 1.0, 0.0), rtol=1e-6
    )
    assert layer.activation is activation


def test_a_call_applying_its_activation_twice_is_refused() -> None:
    layer = TwiceActivated(3, activation="relu")
    layer.build((None, 2))
    activation = layer.activation
    x = np.ones((4, 2), "float32")
    with pytest.raises(RuntimeError, match=r"applied its `activation` 2 times .* be tapped\.$"):
        marked_preactivation_call(layer, layer.call, (x,), {}, lambda z: z, "tapped.")
    assert layer.activation is activation
