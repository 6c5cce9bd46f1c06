"""`kgt.register_rule` on JAX: a registered rule written in `keras.ops` runs on the JAX
engine (its path in `gradient_tracking_summary`, oracle-exact values); one that cannot
run there (TensorFlow ops) fails with an error that says so."""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest
from backend_oracle import tracked_statistics
from jax_oracle import assert_matches_oracle, oracle_statistics
from keras import ops

import keras_gradtrack as kgt


class Scale(keras.layers.Layer):
    """`y = x * w`, one weight per feature."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[-1:], initializer="ones")

    def call(self, x):
        return x * self.w


def scale_per_example(layer, calls):
    grads = []
    for call in calls:  # both (B, ..., features)
        x = ops.cast(call.inputs, "float32")
        d = ops.cast(call.output_grad, "float32")
        grads.append(ops.sum(x * d, axis=tuple(range(1, len(x.shape) - 1))))
    return [(layer.w, sum(grads[1:], grads[0]))]


@pytest.fixture
def registered() -> Iterator[None]:
    rule = kgt.rules.Rule.from_per_example("scale", scale_per_example)
    previous = kgt.register_rule(Scale, rule)
    yield
    kgt.register_rule(Scale, previous)


def scaled_model() -> kgt.GradientTrackingModel:
    inputs = keras.Input((5, 4))
    hidden = Scale()(keras.layers.Dense(4)(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def test_a_registered_keras_ops_rule_runs_on_jax_oracle_exact(registered: None) -> None:
    model = scaled_model()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 5, 4)).astype("float32"), rng.integers(0, 3, 6)
    model(x[:1])
    summary = model.gradient_tracking_summary(print_fn=lambda text: None)
    (line,) = [line for line in summary.splitlines() if "Scale" in line]
    assert line.endswith("rule:scale"), summary
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_a_rule_in_tensorflow_ops_says_it_cannot_run_on_jax() -> None:
    import tensorflow as tf  # the suite's conftest imports it anyway

    def in_tensorflow_ops(layer, calls):
        (call,) = calls
        x, d = tf.cast(call.inputs, tf.float32), tf.cast(call.output_grad, tf.float32)
        return [(layer.w, tf.reduce_sum(x * d, axis=1))]

    rule = kgt.rules.Rule.from_per_example("tf_scale", in_tensorflow_ops)
    previous = kgt.register_rule(Scale, rule)
    try:
        model = scaled_model()
        x, y = np.ones((4, 5, 4), "float32"), np.zeros(4, "int64")
        with pytest.raises(ValueError, match=r"tf_scale.*JAX.*keras\.ops"):
            tracked_statistics(model, x, y)
    finally:
        kgt.register_rule(Scale, previous)


def test_a_rule_with_primitives_only_is_refused_clearly() -> None:
    rule = kgt.rules.Rule("primitives_only", lambda layer, calls, reference: None)
    previous = kgt.register_rule(Scale, rule)
    try:
        model = scaled_model()
        model(np.ones((1, 5, 4), "float32"))
        with pytest.raises(ValueError, match=r"primitives_only.*per_example"):
            model.gradient_tracking_summary(print_fn=lambda text: None)
    finally:
        kgt.register_rule(Scale, previous)
