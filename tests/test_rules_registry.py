"""The public rule registry: a user's own rule, subclasses along the MRO, frozen kernels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.engine.tracked_layer import FALLBACK_PATH

rng = np.random.default_rng(21)
X = rng.normal(size=(12, 5, 4)).astype("float32")
Y = rng.integers(0, 3, 12)


class Scale(keras.layers.Layer):
    """`y = x * w`, one weight per feature (no rule of its own)."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=input_shape[-1:], initializer="random_normal", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w


def scale_per_example(layer: Any, calls: Any) -> list[tuple[Any, tf.Tensor]]:
    grads = []
    for call in calls:
        x, d = tf.cast(call.inputs, tf.float32), tf.cast(call.output_grad, tf.float32)
        grads.append(tf.reduce_sum(x * d, axis=list(range(1, len(x.shape) - 1))))
    return [(layer.w, tf.add_n(grads))]


# Scale has no `activation`: the default taps its outputs.
SCALE_RULE = kgt.rules.Rule.from_per_example("scale", scale_per_example)


class KeepsCall(keras.layers.Dense):
    """A Dense subclass that keeps Dense's call."""


class OverridesCall(keras.layers.Dense):
    """A Dense subclass with a call of its own (here: the same math)."""

    def call(self, inputs: Any, training: Any = None) -> Any:
        return super().call(inputs)


@pytest.fixture
def registered() -> Iterator[list[type]]:
    """Classes registered in a test; their rules are removed afterwards."""
    classes: list[type] = []
    yield classes
    for cls in classes:
        kgt.register_rule(cls, None)


def model_with(*layers: Any) -> Any:
    inputs = keras.Input((5, 4))
    hidden = inputs
    for layer in layers:
        hidden = layer(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def paths(model: Any) -> list[str]:
    return [tracked.path for tracked in model.gradient_tracking_plan()]


def test_a_users_rule_for_a_users_layer_is_exact(registered: list[type]) -> None:
    model = model_with(Scale(name="scale"), keras.layers.Dense(6, activation="tanh"))
    assert paths(model)[0] == FALLBACK_PATH
    registered.append(Scale)  # removed afterwards even if the assertion fails
    assert kgt.register_rule(Scale, SCALE_RULE) is None
    assert paths(model)[0] == "rule:scale"
    stats = model.gradient_statistics(X, Y)
    assert_matches_oracle(stats, oracle_statistics(model, X, Y))
    assert model.gradient_tracking.forms["scale"] == "materialized"


def test_a_subclass_that_keeps_call_uses_the_parents_rule() -> None:
    model = model_with(KeepsCall(6, activation="relu"))
    assert paths(model)[0] == "rule:dense"
    assert_matches_oracle(model.gradient_statistics(X, Y), oracle_statistics(model, X, Y))


def test_a_subclass_that_overrides_call_goes_to_the_fallback_and_says_why(
    registered: list[type],
) -> None:
    model = model_with(OverridesCall(6, activation="relu", name="custom"))
    plan = model.gradient_tracking_plan()
    assert plan[0].path == FALLBACK_PATH
    assert "OverridesCall overrides the call() of Dense" in plan[0].reason
    summary = model.gradient_tracking_summary(print_fn=lambda _: None)
    assert "register_rule(OverridesCall, rule)" in summary
    assert_matches_oracle(model.gradient_statistics(X, Y), oracle_statistics(model, X, Y))

    kgt.register_rule(OverridesCall, kgt.rules.DENSE)
    registered.append(OverridesCall)
    assert paths(model)[0] == "rule:dense"
    assert_matches_oracle(model.gradient_statistics(X, Y), oracle_statistics(model, X, Y))


@pytest.mark.parametrize("frozen", ["kernel", "bias"])
@pytest.mark.parametrize("rank", [2, 3])
def test_dense_with_a_frozen_variable_stays_on_its_rule(frozen: str, rank: int) -> None:
    layer = keras.layers.Dense(6, activation="relu", name="partly_frozen")
    inputs = keras.Input((5, 4) if rank == 3 else (4,))
    hidden = layer(inputs)
    if rank == 3:
        hidden = keras.layers.Flatten()(hidden)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    getattr(layer, frozen).trainable = False
    x = X if rank == 3 else X[:, 0]
    y = rng.normal(size=(12, 3)).astype("float32")
    assert paths(model)[0] == "rule:dense"
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


@pytest.mark.parametrize(
    ("layer_class", "rule", "match"),
    [
        (object, SCALE_RULE, "keras.layers.Layer subclass"),
        (Scale, scale_per_example, "keras_gradtrack.rules.Rule"),
    ],
)
def test_register_rule_checks_its_arguments(layer_class: Any, rule: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        kgt.register_rule(layer_class, rule)


def uncast_per_example(layer: Any, calls: Any) -> list[tuple[Any, tf.Tensor]]:
    """Computes in the inputs' dtype: float16 gradients under mixed precision."""
    x = calls[0].inputs
    return [(layer.w, tf.reduce_sum(x * tf.cast(calls[0].output_grad, x.dtype), axis=1))]


def misshaped_per_example(layer: Any, calls: Any) -> list[tuple[Any, tf.Tensor]]:
    """Keeps the time axis: `(B, T, features)` for a `(features,)` weight."""
    call = calls[0]
    return [(layer.w, tf.cast(call.inputs * call.output_grad, tf.float32))]


@pytest.mark.parametrize(
    ("per_example", "policy", "error", "match"),
    [
        (uncast_per_example, "mixed_float16", TypeError, "must be float32.*dtype=float16"),
        (
            misshaped_per_example,
            "float32",
            ValueError,
            r"laid out.*\(None, 4\).*shape=\(\d+, 5, 4\)",
        ),
    ],
)
def test_the_engine_names_the_rule_and_variable_that_break_the_contract(
    registered: list[type], per_example: Any, policy: str, error: type, match: str
) -> None:
    kgt.register_rule(Scale, kgt.rules.Rule.from_per_example("bad_scale", per_example))
    registered.append(Scale)
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = model_with(Scale(name="scale"))
        with pytest.raises(
            error, match=f"Rule 'bad_scale' on layer 'scale', variable 'scale/w'.*{match}"
        ):
            model.gradient_statistics(X, Y)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_the_documented_rule_holds_under_mixed_precision(registered: list[type]) -> None:
    kgt.register_rule(Scale, SCALE_RULE)
    registered.append(Scale)
    reference = model_with(Scale(name="scale"))
    expected = oracle_statistics(reference, X, Y)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = model_with(Scale(name="scale"))
        model.set_weights(reference.get_weights())
        stats = model.gradient_statistics(X, Y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    np.testing.assert_allclose(stats["grad_norm"], expected["grad_norm"], rtol=5e-3)


def test_the_rules_package_exports_the_contract_not_the_engines_lookup() -> None:
    exported = set(kgt.rules.__all__)
    assert {"Rule", "LayerCall", "Reference", "register_rule", "PRELU"} <= exported
    assert not exported & {"lookup", "Lookup", "rule_for"}
    assert all(hasattr(kgt.rules, name) for name in exported)
