"""`kgt.check` on every engine (TensorFlow, JAX, PyTorch; each backend's test module
imports these): the path of each tracked layer, the refusals a tracked step would
make (a layer, and with a batch the example-independence guard), before training and
without changing any weight."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

RNG = np.random.default_rng(21)
X = RNG.normal(size=(16, 8)).astype("float32")
Y = RNG.normal(size=(16, 3)).astype("float32")


@keras.saving.register_keras_serializable(package="check_cases")
class Scaled(keras.layers.Layer):
    """A layer with a weight of its own and no rule: the fallback's."""

    def build(self, input_shape: Any) -> None:
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x: Any) -> Any:
        return x * self.scale


def compiled(hidden: Any) -> Any:
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3, name="head")(hidden(inputs))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def dense(x: Any) -> Any:
    return keras.layers.Dense(4, activation="relu", name="hidden")(x)


def batch_centered(x: Any) -> Any:
    """Each example minus the batch's mean: its output depends on the other examples."""
    hidden = keras.layers.Dense(4, name="hidden")(x)
    return keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(hidden)


def weights_of(model: Any) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.weights]


def test_check_lists_each_tracked_layer_with_its_path() -> None:
    model = compiled(lambda x: Scaled(name="scaled")(dense(x)))
    report = kgt.check(model)
    assert [row.name for row in report.layers] == ["hidden", "scaled", "head"]
    assert [row.path for row in report.layers] == ["rule:dense", "fallback", "rule:dense"]
    assert [row.num_parameters for row in report.layers] == [36, 4, 15]
    assert report.fallback_layers == ["scaled"]
    assert report.refusals == []
    table = str(report)
    assert "hidden" in table and "3 tracked layers, 1 on the fallback path, 0 refused" in table


def test_check_with_a_batch_refuses_a_model_that_mixes_the_examples() -> None:
    model = compiled(batch_centered)
    before = weights_of(model)
    assert kgt.check(model).refusals == []  # the guard needs a batch
    refusals = kgt.check(model, x=X, y=Y).refusals
    assert len(refusals) == 1 and "mixes the examples" in refusals[0], refusals
    for was, now in zip(before, weights_of(model)):
        np.testing.assert_array_equal(was, now)
    model.check_example_independence = False
    assert kgt.check(model, x=X, y=Y).refusals == []


def test_check_with_a_batch_passes_a_model_that_keeps_the_examples_apart() -> None:
    assert kgt.check(compiled(dense), x=X, y=Y).refusals == []


def test_check_refuses_batch_normalization_in_training_naming_the_opt_in() -> None:
    model = compiled(lambda x: keras.layers.BatchNormalization(name="bn")(dense(x)))
    refusals = kgt.check(model).refusals
    assert len(refusals) == 1, refusals
    assert "'bn'" in refusals[0] and "track_batch_normalization = True" in refusals[0]


def test_check_builds_an_unbuilt_model_from_a_batch() -> None:
    model = kgt.GradientTrackingSequential([keras.layers.Dense(3, name="only")])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="not built yet"):
        kgt.check(model)
    report = kgt.check(model, x=X, y=Y)
    assert model.built and [row.name for row in report.layers] == ["only"]


def test_check_refuses_what_is_not_a_tracking_model() -> None:
    inputs = keras.Input((8,))
    plain = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    with pytest.raises(TypeError, match="GradientTrackingMixin"):
        kgt.check(plain)


def sequence_model() -> Any:
    """A Dense on sequences (its per-example gradients materialized), the fallback, and a
    Dense on vectors (the direct form), with a dropout drawing from its seed."""
    inputs = keras.Input((6, 8))
    hidden = keras.layers.Dense(4, name="tokens")(inputs)
    hidden = keras.layers.Dropout(0.5)(keras.layers.Flatten()(hidden))
    outputs = keras.layers.Dense(3, name="head")(Scaled(name="scaled")(hidden))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


SEQUENCES = RNG.normal(size=(16, 6, 8)).astype("float32")
SEQUENCE_FORMS = ["materialized", "jacobian", "direct"]


def test_check_with_a_batch_gives_each_layers_form_and_changes_nothing() -> None:
    model = sequence_model()
    before = weights_of(model)  # the seed generator's state among them
    report = kgt.check(model, x=SEQUENCES, y=Y)
    assert [row.form for row in report.layers] == SEQUENCE_FORMS
    assert report.refusals == [] and "Forms (-)" not in str(report)
    for was, now in zip(before, weights_of(model), strict=True):
        np.testing.assert_array_equal(was, now)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0


def test_check_after_a_tracked_fit_gives_the_forms_the_steps_took() -> None:
    model = sequence_model()
    logs = kgt.GradientStatisticsToLogs()
    model.fit(SEQUENCES, Y, batch_size=8, epochs=1, verbose=0, callbacks=[logs])
    assert [row.form for row in kgt.check(model).layers] == SEQUENCE_FORMS
