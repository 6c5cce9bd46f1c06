"""Know before you train: `kgt.check(model)` and `gradient_tracking_summary()` before any
step say, per layer, the path it will take (rule and form, fallback, refused) and why,
from one symbolic trace of the forward pass that changes nothing.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import keras_gradtrack as kgt

rng = np.random.default_rng(5)


class Scale(layers.Layer):
    """A layer without a rule: the fallback."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=input_shape[-1:], initializer="ones")

    def call(self, x: Any) -> Any:
        return x * self.w


class Looped(layers.Layer):
    """Calls its Dense twice inside a tf.while_loop."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = layers.Dense(6, activation="tanh")

    def call(self, x: Any) -> Any:
        return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, self.dense(h)), (0, x))[1]


class TiedOutput(layers.Layer):
    """Projects onto the vocabulary with an Embedding's table (weight tying)."""

    def __init__(self, embedding: layers.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def call(self, h: Any) -> Any:
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def rows(report: Any) -> dict[str, Any]:
    return {row.name: row for row in report.layers}


def test_before_any_step_each_layer_shows_its_path_form_and_why() -> None:
    inputs = keras.Input((5, 4))
    sequence = layers.Dense(6, name="sequence_dense")(inputs)  # T=5: materialized
    scaled = Scale(name="scale")(sequence)
    pooled = layers.GlobalAveragePooling1D()(scaled)
    normalized = layers.BatchNormalization(name="batch_norm")(pooled)
    outputs = layers.Dense(3, name="head")(normalized)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")

    report = kgt.check(model)
    found = rows(report)
    assert list(found) == ["sequence_dense", "scale", "batch_norm", "head"]
    assert (found["sequence_dense"].path, found["sequence_dense"].form) == (
        "rule:dense",
        "materialized",
    )
    assert (found["head"].path, found["head"].form) == ("rule:dense", "direct")
    assert (found["scale"].path, found["scale"].form) == ("fallback", "jacobian")
    assert "no rule registered for Scale" in found["scale"].note
    assert report.fallback_layers == ["scale"]
    assert found["batch_norm"].path == "refused"
    assert "'batch_norm' is a BatchNormalization in training mode" in found["batch_norm"].refusal
    assert report.refusals == [found["batch_norm"].refusal]

    summary = model.gradient_tracking_summary(print_fn=lambda _: None)
    assert "4 tracked layers, 1 on the fallback path, 1 refused" in summary
    assert f"refused: {found['batch_norm'].refusal}" in summary
    # The tracked step refuses what the summary said it would.
    with pytest.raises(ValueError, match="'batch_norm' is a BatchNormalization"):
        model.gradient_statistics(rng.normal(size=(4, 5, 4)), rng.normal(size=(4, 3)))


def test_checking_changes_no_weight_no_optimizer_and_no_random_state() -> None:
    inputs = keras.Input((4,))
    hidden = layers.Dropout(0.5)(layers.Dense(6)(inputs))
    normalized = layers.BatchNormalization()(hidden)  # its moving statistics would move
    model = kgt.GradientTrackingModel(inputs, layers.Dense(2)(normalized))
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    seeds = [
        layer.seed_generator.state.numpy().copy()
        for layer in model.layers
        if isinstance(layer, layers.Dropout)
    ]
    kgt.check(model)
    model.gradient_tracking_summary(print_fn=lambda _: None)
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    dropout = next(layer for layer in model.layers if isinstance(layer, layers.Dropout))
    assert np.array_equal(dropout.seed_generator.state.numpy(), seeds[0])


def test_a_layer_called_inside_a_loop_is_shown_refused() -> None:
    inputs = keras.Input((6,))
    looped = Looped()
    model = kgt.GradientTrackingModel(inputs, layers.Dense(2, name="head")(looped(inputs)))
    found = rows(kgt.check(model))
    assert found[looped.dense.name].path == "refused"
    assert "inside a loop of the traced step" in found[looped.dense.name].refusal
    assert found["head"].path == "rule:dense"


def test_tied_weights_are_shown_refused() -> None:
    inputs = keras.Input((5,), dtype="int32")
    embedding = layers.Embedding(10, 4, name="tokens")
    hidden = layers.Dense(4, name="hidden")(embedding(inputs))
    model = kgt.GradientTrackingModel(inputs, TiedOutput(embedding)(hidden))
    found = rows(kgt.check(model))
    assert found["tokens"].path == "refused"
    assert "tied weights" in found["tokens"].refusal
    assert found["hidden"].path == "rule:dense"


def test_a_loss_added_in_call_is_a_refusal_of_the_model() -> None:
    inputs = keras.Input((4,))
    hidden = layers.Dense(3, activity_regularizer="l2", name="regularized")(inputs)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(1)(hidden))
    report = kgt.check(model)
    assert len(report.refusals) == 1
    assert "'regularized' (Dense) has an activity regularizer" in report.refusals[0]
    assert all(row.path.startswith("rule:") for row in report.layers)
    assert "refused: Layer 'regularized' (Dense) has an activity regularizer" in str(report)


class Subclassed(kgt.GradientTrackingModel):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = layers.Dense(5, activation="relu")
        self.out = layers.Dense(2)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def test_a_subclassed_model_is_checked_from_its_first_call_or_from_inputs() -> None:
    built = Subclassed()
    built(np.zeros((2, 3, 4), "float32"))
    assert [row.form for row in kgt.check(built).layers] == ["materialized", "materialized"]

    class TwoInputs(kgt.GradientTrackingModel):
        def __init__(self) -> None:
            super().__init__()
            self.dense = layers.Dense(2)

        def call(self, inputs: Any) -> Any:
            return self.dense(ops.concatenate(inputs, axis=-1))

    model = TwoInputs()
    model((np.zeros((2, 3), "float32"), np.zeros((2, 1), "float32")))
    unknown = kgt.check(model)
    assert [row.form for row in unknown.layers] == ["-"]
    assert "Forms (-) are known after the first tracked step" in str(unknown)
    # Only shapes and dtypes are read: a spec does as well as arrays.
    specs = (tf.TensorSpec((None, 3)), tf.TensorSpec((None, 1)))
    assert [row.form for row in kgt.check(model, x=specs).layers] == ["direct"]


def test_a_batch_builds_an_unbuilt_subclassed_model() -> None:
    model = Subclassed()
    report = kgt.check(model, x=rng.normal(size=(4, 3, 4)).astype("float32"))
    assert model.built
    assert [row.path for row in report.layers] == ["rule:dense", "rule:dense"]
    assert report.refusals == []


def test_unknown_sequence_lengths_are_said() -> None:
    inputs = keras.Input((None, 4))
    model = kgt.GradientTrackingModel(inputs, layers.Dense(2)(inputs))
    assert "Some input sizes besides the batch's are unknown" in str(kgt.check(model))
    assert "unknown" not in str(kgt.check(model, x=np.zeros((1, 7, 4), "float32")))


def test_what_cannot_be_checked_says_why() -> None:
    plain = keras.Sequential([keras.Input((3,)), layers.Dense(2)])
    with pytest.raises(TypeError, match="Expected a Keras model with GradientTrackingMixin"):
        kgt.check(plain)
    with pytest.raises(ValueError, match="is not built yet"):
        kgt.check(Subclassed())
