"""What private training on JAX does not do yet is refused before any weight changes,
with an error naming the JAX backend."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

X, Y = np.ones((8, 4), "float32"), np.zeros(8, "int32")


def model(optimizer: Any = "sgd") -> Any:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3)(inputs)
    found = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))
    found.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return found


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"adaptive_clip": kgt.privacy.AdaptiveClip()}, "Adaptive clipping"),
    ],
)
def test_what_jax_does_not_have_yet_is_refused(arguments: dict[str, Any], match: str) -> None:
    m = model()
    with pytest.raises(NotImplementedError, match=f"{match}.*JAX backend"):
        m.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, **arguments)
    assert m.privacy_settings is None and m.privacy_history == ()


def test_a_loss_scale_optimizer_is_refused() -> None:
    m = model(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(NotImplementedError, match=r"LossScaleOptimizer.*JAX backend"):
        m.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)


def test_a_model_with_its_own_train_step_is_refused() -> None:
    class OwnStep(kgt.GradientTrackingModel):
        def train_step(self, state: Any, data: Any) -> Any:
            return super().train_step(state, data)

    inputs = keras.Input((4,))
    m = OwnStep(inputs, keras.layers.Dense(2)(inputs))
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(NotImplementedError, match=r"own train_step.*JAX backend"):
        m.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)


def test_an_added_loss_is_refused_before_any_weight_changes() -> None:
    class Penalized(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            self.add_loss(0.01 * keras.ops.sum(x**2))
            return x

    inputs = keras.Input((4,))
    hidden = Penalized()(keras.layers.Dense(3)(inputs))
    m = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(hidden))
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
