"""What private training refuses on a probed engine (JAX, PyTorch), as on TensorFlow, before any weight changes:
losses that are not sums of per-example terms (`add_loss`, in Keras' step or in a
step of the model's own) and BatchNormalization in training."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

X, Y = np.ones((8, 4), "float32"), np.zeros(8, "int32")


class Penalized(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        self.add_loss(0.01 * keras.ops.sum(x**2))
        return x


class SuperStep(kgt.GradientTrackingModel):
    def train_step(self, state: Any, data: Any) -> Any:
        return super().train_step(state, data)


class DoubledLoss(kgt.GradientTrackingModel):
    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return 2.0 * super().compute_loss(*args, **kwargs)


# A train_step of one's own (JAX's signature) is tracked on JAX; PyTorch refuses it.
OWN_STEPS = [SuperStep] if keras.backend.backend() == "jax" else []


@pytest.mark.parametrize("model_class", [kgt.GradientTrackingModel, *OWN_STEPS, DoubledLoss])
def test_an_added_loss_is_refused_before_any_weight_changes(model_class: type) -> None:
    inputs = keras.Input((4,))
    hidden = Penalized()(keras.layers.Dense(3)(inputs))
    m = model_class(inputs, keras.layers.Dense(2)(hidden))
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    before = m.get_weights()
    with pytest.raises(ValueError, match=r"add_loss.*not a sum of per-example terms"):
        m.fit(X, Y, batch_size=4, verbose=0)
    for got, want in zip(m.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert m.private_steps == 0


def test_batch_normalization_is_refused_as_on_tensorflow() -> None:
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(3)(inputs))
    m = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="BatchNormalization in training mode"):
        m.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
