"""Layers whose rule builds per-example gradients take their batch gradient from them.

For those layers the backward pass skips the weight gradient and the update uses
the sum of the per-example gradients instead; these tests check that the update
is still Keras' own (same weights after several steps) on one device, with weight
regularizers and sample weights, under MirroredStrategy, and under mixed precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
L = keras.layers
REGULARIZER = keras.regularizers.L2(0.02)
X = rng.normal(size=(24, 8, 8, 3)).astype("float32")
Y = rng.integers(0, 3, 24)
WEIGHTS = rng.uniform(0.0, 2.0, 24).astype("float32")

# Layer name -> the form its rule takes for this model's shapes.
FORMS = {
    "conv": "materialized",
    "depthwise": "materialized",
    "separable": "materialized",
    "transpose": "materialized",
    "group_norm": "materialized",
    "dense_sequence": "materialized",
    "layer_norm": "materialized",
    "einsum": "materialized",
    "rms_norm": "materialized",
    "classifier": "direct",
}


def build(model_class: type = kgt.GradientTrackingModel, optimizer: str = "adam") -> Any:
    inputs = keras.Input((8, 8, 3))
    h = L.Conv2D(
        4, 3, padding="same", activation="relu", kernel_regularizer=REGULARIZER, name="conv"
    )(inputs)
    h = L.DepthwiseConv2D(3, depth_multiplier=2, activation="tanh", name="depthwise")(h)
    h = L.SeparableConv2D(4, 3, padding="same", name="separable")(h)
    h = L.Conv2DTranspose(3, 2, strides=2, activation="relu", name="transpose")(h)
    h = L.GroupNormalization(groups=3, name="group_norm")(h)
    h = L.Reshape((144, 3))(h)
    h = L.Dense(5, activation="relu", kernel_regularizer=REGULARIZER, name="dense_sequence")(h)
    h = L.LayerNormalization(name="layer_norm")(h)
    h = L.EinsumDense("abc,cd->abd", output_shape=(144, 4), bias_axes="d", name="einsum")(h)
    h = L.RMSNormalization(name="rms_norm")(h)
    outputs = L.Dense(3, name="classifier", dtype="float32")(L.Flatten()(h))
    model = model_class(inputs, outputs)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def fit(model: Any, callbacks: list[Any], epochs: int = 2) -> Any:
    return model.fit(
        X,
        Y,
        sample_weight=WEIGHTS,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def assert_same_weights(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for variable, value in zip(actual.weights, expected.get_weights()):
        np.testing.assert_allclose(
            variable.numpy(), value, rtol=rtol, atol=atol, err_msg=variable.path
        )


def test_updates_equal_plain_keras_and_the_summary_names_each_form(tmp_path: Path) -> None:
    plain = build(keras.Model)
    tracked = build()
    tracked.set_weights(plain.get_weights())
    assert "-" in tracked.gradient_tracking_summary(print_fn=lambda _: None)
    plain_history = fit(plain, [])
    tracked_history = fit(tracked, [kgt.HDF5GradientLogger(tmp_path / "run.h5")])
    # Adam divides by the root of the second moment, which turns rounding-level
    # differences of small gradient entries (1e-7 of the largest) into up to 1e-5
    # differences of the weights after six steps (a wrong entry moves by 1e-3 a step).
    assert_same_weights(tracked, plain, atol=5e-5)
    np.testing.assert_allclose(
        # The losses follow those weights: up to 1.2e-4 apart with oneDNN on under a
        # loaded machine (its reductions' order follows the threads); a wrong step moves
        # them by 1e-2.
        tracked_history.history["loss"],
        plain_history.history["loss"],
        rtol=3e-4,
    )
    assert tracked.gradient_tracking.forms == FORMS
    summary = tracked.gradient_tracking_summary(print_fn=lambda _: None)
    assert "materialized" in summary and "direct" in summary


def test_updates_equal_plain_keras_under_mirrored_strategy(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    strategy = two_cpu_strategy
    with strategy.scope():
        distributed = build(optimizer="sgd")
    plain = build(keras.Model, optimizer="sgd")
    plain.set_weights(distributed.get_weights())
    fit(plain, [], epochs=1)
    fit(distributed, [kgt.HDF5GradientLogger(tmp_path / "run.h5")], epochs=1)
    assert_same_weights(distributed, plain)


def test_updates_under_mixed_float16_follow_plain_keras(tmp_path: Path) -> None:
    """Loss scaling: the derived gradients reach the optimizer scaled like the others.

    Plain Keras forms these weight gradients in float16, the derived ones sum
    float32 per-example gradients, hence the looser tolerance; a missing or
    doubled loss scale (2**15) would be far outside it.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = build(keras.Model, optimizer="sgd")
        tracked = build(optimizer="sgd")
        assert isinstance(tracked.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    tracked.set_weights(plain.get_weights())
    fit(plain, [], epochs=1)
    fit(tracked, [kgt.HDF5GradientLogger(tmp_path / "run.h5")], epochs=1)
    assert_same_weights(tracked, plain, rtol=2e-2, atol=2e-3)


def test_statistics_with_materialized_layers_match_the_oracle() -> None:
    model = build(optimizer="sgd")
    expected = oracle_statistics(model, X[:8], Y[:8], WEIGHTS[:8])
    found = model.gradient_statistics(X[:8], Y[:8], sample_weight=WEIGHTS[:8])
    assert_matches_oracle(found, expected)
    assert model.gradient_tracking.forms == FORMS
