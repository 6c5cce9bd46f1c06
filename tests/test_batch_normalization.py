"""BatchNormalization: exact through the batch statistics (opt-in), frozen, or converted.

In training mode `g_i = d l_i / d theta` holds the other examples fixed; the
oracle is the gradient of each `l_i` of the full-batch forward
(`oracle_statistics(..., full_batch=True)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

layers = keras.layers
rng = np.random.default_rng(77)
X = rng.normal(size=(5, 6, 3)).astype("float32")
Y = rng.integers(0, 3, 5)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(model: Any, loss: Any = LOSS, chunk_size: int | None = 2) -> Any:
    model.compile(optimizer="sgd", loss=loss)
    if chunk_size is not None:
        model.track_batch_normalization = True
        model.batch_normalization_chunk_size = chunk_size
    return model


def timeseries_model(blocks: int = 2, **norm: Any) -> Any:
    """The Keras timeseries classifier from scratch, small: (Conv1D, BN, ReLU) blocks."""
    inputs = keras.Input((6, 3))
    hidden = inputs
    for block in range(blocks):
        hidden = layers.Conv1D(4, 3, padding="same", name=f"conv{block}")(hidden)
        hidden = layers.BatchNormalization(name=f"bn{block}", **norm)(hidden)
        hidden = layers.ReLU()(hidden)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    return kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden))


def matches_full_batch_oracle(model: Any, x: Any = X, y: Any = Y, **kwargs: Any) -> dict:
    # The oracle's forward starts from the state the step's started from (batch
    # renormalization reads the moving statistics that a forward updates).
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    stats = model.gradient_statistics(x, y, **kwargs)
    for variable, value in state:
        variable.assign(value)
    sample_weight = kwargs.get("sample_weight")
    assert_matches_oracle(stats, oracle_statistics(model, x, y, sample_weight, full_batch=True))
    return stats


# -- training mode, opted in -------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 8])
def test_training_mode_matches_the_full_batch_oracle_for_every_chunk_size(chunk_size: int) -> None:
    # 5 examples: chunks of 2 end with a partial one, a chunk of 8 holds them all.
    matches_full_batch_oracle(compiled(timeseries_model(), chunk_size=chunk_size))


def test_layers_before_a_batch_normalization_are_coupled_the_others_keep_their_rules() -> None:
    model = compiled(timeseries_model())
    matches_full_batch_oracle(model)
    assert model.gradient_tracking.forms == {
        "conv0": "coupled",
        "bn0": "coupled",  # bn1 follows it
        "conv1": "coupled",
        "bn1": "materialized",  # rule:batch_normalization, with the batch's moments
        "head": "direct",
    }
    assert "coupled" in model.gradient_tracking_summary(print_fn=lambda _: None)


def test_per_example_gradients_sum_to_the_batch_gradient() -> None:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model = compiled(timeseries_model(), loss=loss)
    expected = oracle_statistics(model, X, Y, full_batch=True)
    summed = expected["per_example_gradients"].sum(axis=0)
    np.testing.assert_allclose(np.linalg.norm(summed), expected["batch_grad_norm"], rtol=1e-5)
    assert_matches_oracle(model.gradient_statistics(X, Y), expected)


def test_sample_weights_and_pairwise_cosine() -> None:
    model = compiled(timeseries_model())
    weights = rng.uniform(0.5, 2.0, 5).astype("float32")
    matches_full_batch_oracle(
        model, sample_weight=weights, statistics=["pairwise_cosine", "cosine", "layer_grad_norm"]
    )


def test_a_dense_network_with_batch_normalization_on_another_axis_and_a_regularizer() -> None:
    # G includes the penalty's gradient, the coupled g_i do not (as for every layer).
    inputs = keras.Input((6, 3))
    regularizer = keras.regularizers.L2(0.1)
    hidden = layers.Dense(4, kernel_regularizer=regularizer, name="dense")(inputs)
    hidden = layers.BatchNormalization(axis=1, name="bn_positions")(hidden)
    hidden = layers.Dense(4, activation="relu", name="dense2")(layers.Flatten()(hidden))
    hidden = layers.BatchNormalization(name="bn_features")(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    matches_full_batch_oracle(model)


def test_batch_normalization_without_gamma_and_beta_still_couples_the_layers_before() -> None:
    model = compiled(timeseries_model(blocks=1, center=False, scale=False))
    matches_full_batch_oracle(model)
    assert model.gradient_tracking.forms == {"conv0": "coupled", "head": "direct"}


def test_batch_renormalization_goes_through_the_batch_statistics() -> None:
    model = compiled(timeseries_model(blocks=1, renorm=True))
    model(X[:2], training=True)  # moves the renormalization statistics off their start
    matches_full_batch_oracle(model)
    assert model.gradient_tracking.forms["bn0"] == "coupled"


def test_masked_positions_do_not_enter_the_moments() -> None:
    inputs = keras.Input((6,), dtype="int32")
    hidden = layers.Embedding(10, 4, mask_zero=True, name="embedding")(inputs)
    hidden = layers.Dense(4, name="dense")(hidden)
    hidden = layers.BatchNormalization(name="bn")(hidden)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    tokens = rng.integers(1, 10, (5, 6))
    tokens[:, 4:] = 0
    matches_full_batch_oracle(model, tokens)
    assert model.gradient_tracking.forms["bn"] == "materialized"


class PerExampleLossStep(kgt.GradientTrackingMixin, keras.Model):
    """A step of its own, passing the per-example losses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = layers.Conv1D(4, 3, name="conv0")
        self.norm = layers.BatchNormalization(name="bn0")
        self.head = layers.Dense(3, name="head")

    def call(self, x: Any, training: bool = False) -> Any:
        hidden = self.norm(self.conv(x), training=training)
        return self.head(tf.reduce_mean(hidden, axis=1))

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(
                y, self(x, training=True), from_logits=True
            )
            loss = tf.reduce_mean(per_example)
        grads = self.tracked_gradient(
            tape, loss, self.trainable_weights, per_example_loss=per_example
        )
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


def test_a_train_step_of_its_own_with_per_example_losses(tmp_path: Path) -> None:
    model = compiled(PerExampleLossStep())
    model(X[:1])
    before = [w.copy() for w in model.get_weights()]
    expected = oracle_statistics(model, X, Y, full_batch=True)
    model.set_weights(before)
    model.fit(
        X,
        Y,
        batch_size=5,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["layer_grad_norm"])],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        np.testing.assert_allclose(
            log.per_example("layer_grad_norm"), expected["layer_grad_norm"], rtol=1e-4
        )


def test_fit_updates_the_weights_as_keras_does_and_logs_every_nth_step(tmp_path: Path) -> None:
    tracked = compiled(timeseries_model())
    tracked.compile(optimizer="adam", loss=LOSS)
    plain = keras.Model.from_config(tracked.get_config())
    plain.set_weights(tracked.get_weights())
    plain.compile(optimizer="adam", loss=LOSS)
    x = rng.normal(size=(12, 6, 3)).astype("float32")
    y = rng.integers(0, 3, 12)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", every_n_steps=2)
    tracked.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[logger])
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(tracked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        np.testing.assert_array_equal(log.per_step("step"), [0, 2, 4])
        assert np.isfinite(log.per_example("cosine")).all()


def test_an_xla_compiled_step_is_exact(tmp_path: Path) -> None:
    # Each chunk's example indices have a static length, which XLA requires.
    model = compiled(timeseries_model(blocks=1))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=LOSS, jit_compile=True)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["layer_grad_norm"])
    model.fit(X, Y, batch_size=5, shuffle=False, verbose=0, callbacks=[logger])
    expected = oracle_statistics(model, X, Y, full_batch=True)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        np.testing.assert_allclose(
            log.per_example("layer_grad_norm"), expected["layer_grad_norm"], rtol=1e-4
        )


def test_mirrored_strategy_couples_the_examples_of_each_replica(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    x = rng.normal(size=(8, 6, 3)).astype("float32")
    y = rng.integers(0, 3, 8)
    with two_cpu_strategy.scope():
        model = compiled(timeseries_model(blocks=1))
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss=LOSS)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss", "layer_grad_norm"])
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    # Each replica normalizes its half of the batch with that half's statistics.
    halves = [
        oracle_statistics(model, x[h], y[h], full_batch=True) for h in (slice(4), slice(4, 8))
    ]
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        for name in ("loss", "layer_grad_norm"):
            expected = np.concatenate([half[name] for half in halves])
            np.testing.assert_allclose(log.per_example(name), expected, rtol=1e-4, err_msg=name)


# -- what is refused ----------------------------------------------------------------


def test_input_gradients_are_refused_through_the_batch_statistics() -> None:
    model = compiled(timeseries_model(blocks=1))
    with pytest.raises(ValueError, match=r"d l_i / d x_i.*Received: \['input_grad_norm'\]"):
        model.gradient_statistics(X, Y, statistics=["input_grad_norm"])


def test_targets_are_refused_through_the_batch_statistics(tmp_path: Path) -> None:
    model = compiled(timeseries_model(blocks=1))
    before = [v.numpy() for v in model.trainable_variables]
    logger = kgt.HDF5GradientLogger(tmp_path / "log.h5", targets=(X[:2], Y[:2]))
    with pytest.raises(ValueError, match=r"layers \['conv0'\] run through a BatchNorm"):
        model.fit(X, Y, batch_size=5, verbose=0, callbacks=[logger])
    for variable, value in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_synchronized_statistics_across_replicas_are_refused(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    with two_cpu_strategy.scope():
        model = compiled(timeseries_model(blocks=1, synchronized=True))
    before = [w.copy() for w in model.get_weights()]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss"])
    with pytest.raises(ValueError, match=r"synchronized=False.*Received: 2 replicas"):
        model.fit(X[:4], Y[:4], batch_size=4, verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("track_batch_normalization", 1, TypeError),
        ("batch_normalization_chunk_size", 0, ValueError),
        ("batch_normalization_chunk_size", True, ValueError),
    ],
)
def test_bad_settings_are_refused(name: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=f"Expected {name}"):
        setattr(timeseries_model(blocks=1), name, value)


def test_opting_in_after_a_refused_fit_traces_the_step_again(tmp_path: Path) -> None:
    model = compiled(timeseries_model(blocks=1), chunk_size=None)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss"])
    with pytest.raises(ValueError, match="track_batch_normalization"):
        model.fit(X, Y, batch_size=5, verbose=0, callbacks=[logger])
    model.track_batch_normalization = True
    model.fit(X, Y, batch_size=5, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.num_examples == 5


# -- inference mode -------------------------------------------------------------------


def test_frozen_batch_normalization_is_exact_and_takes_the_plain_path() -> None:
    model = compiled(timeseries_model(), chunk_size=None)
    for name in ("bn0", "bn1"):
        model.get_layer(name).trainable = False
    model.compile(optimizer="sgd", loss=LOSS)
    stats = model.gradient_statistics(X, Y)
    assert_matches_oracle(stats, oracle_statistics(model, X, Y))
    assert model.gradient_tracking.forms == {
        "conv0": "materialized",
        "conv1": "materialized",
        "head": "direct",
    }


class InferenceModeNorm(kgt.GradientTrackingMixin, keras.Model):
    """A trainable BatchNormalization always called in inference mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = layers.Conv1D(4, 3, name="conv0")
        self.norm = layers.BatchNormalization(name="bn0")
        self.head = layers.Dense(3, name="head")

    def call(self, x: Any) -> Any:
        hidden = self.norm(self.conv(x), training=False)
        return self.head(tf.reduce_mean(hidden, axis=1))


def test_trainable_batch_normalization_in_inference_mode_uses_its_moving_statistics() -> None:
    model = compiled(InferenceModeNorm())
    model(X)
    model.norm.moving_mean.assign(rng.normal(size=4).astype("float32"))
    model.norm.moving_variance.assign(rng.uniform(0.5, 2.0, 4).astype("float32"))
    stats = model.gradient_statistics(X, Y)
    # One example at a time is the oracle here: inference mode does not mix examples.
    assert_matches_oracle(stats, oracle_statistics(model, X, Y))
    assert model.gradient_tracking.forms["bn0"] == "materialized"
    assert model.gradient_tracking.forms["conv0"] == "materialized"


# -- the GroupNormalization conversion ------------------------------------------------


def test_conversion_replaces_trainable_batch_normalization_and_keeps_the_rest() -> None:
    inner_inputs = keras.Input((6, 4))
    inner_hidden = layers.BatchNormalization(name="inner_bn")(inner_inputs)
    inner = keras.Model(inner_inputs, layers.Conv1D(4, 3, name="inner_conv")(inner_hidden))
    inputs = keras.Input((6, 3))
    hidden = layers.Conv1D(4, 3, padding="same", name="conv")(inputs)
    hidden = layers.BatchNormalization(name="bn", gamma_initializer="random_uniform")(hidden)
    hidden = layers.BatchNormalization(name="frozen_bn")(inner(hidden))
    outputs = layers.Dense(3, name="head")(layers.GlobalAveragePooling1D()(hidden))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.get_layer("frozen_bn").trainable = False
    model.compile(optimizer="sgd", loss=LOSS)

    converted = kgt.convert_to_group_normalization(model, groups=3)

    assert type(converted) is type(model) and converted.compiled
    norm = converted.get_layer("bn")
    assert isinstance(norm, layers.GroupNormalization) and norm.groups == 2  # 4 channels
    np.testing.assert_array_equal(norm.gamma.numpy(), model.get_layer("bn").gamma.numpy())
    nested = converted.layers[3]
    assert isinstance(nested.get_layer("inner_bn"), layers.GroupNormalization)
    assert isinstance(converted.get_layer("frozen_bn"), layers.BatchNormalization)
    assert not converted.get_layer("frozen_bn").trainable
    for name in ("conv", "head", "frozen_bn"):
        for ours, theirs in zip(
            converted.get_layer(name).get_weights(), model.get_layer(name).get_weights()
        ):
            np.testing.assert_array_equal(ours, theirs)
    assert any(isinstance(layer, layers.BatchNormalization) for layer in model.layers)
    # Examples are independent now: one example at a time is the oracle, no opt-in.
    stats = converted.gradient_statistics(X, Y)
    assert_matches_oracle(stats, oracle_statistics(converted, X, Y))


def test_conversion_of_a_sequential_model() -> None:
    model = kgt.GradientTrackingSequential(
        [keras.Input((6, 3)), layers.Conv1D(8, 3), layers.BatchNormalization(), layers.Flatten()]
    )
    converted = kgt.convert_to_group_normalization(model)
    assert [type(layer).__name__ for layer in converted.layers] == [
        "Conv1D",
        "GroupNormalization",
        "Flatten",
    ]
    assert converted.layers[1].groups == 8


@pytest.mark.parametrize(
    ("build", "groups", "match"),
    [
        (InferenceModeNorm, 32, "Expected a functional or Sequential model"),
        (timeseries_model, 0, "Expected groups to be a positive int"),
    ],
)
def test_conversion_refuses_what_it_cannot_convert(build: Any, groups: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kgt.convert_to_group_normalization(build(), groups=groups)
