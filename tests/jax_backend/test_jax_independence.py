"""The example-independence guard on JAX: examples that mix are refused before any
weight changes, with the TensorFlow engine's words; a fixed model passes; the switch
works; the guard's passes change no state and no metric."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest
from jax_oracle import assert_matches_oracle, oracle_statistics
from keras import layers, ops

import keras_gradtrack as kgt
from keras_gradtrack import statistics
from keras_gradtrack.backends.jax import independence

rng = np.random.default_rng(5)
ROOT = Path(__file__).resolve().parents[2]


class RecommenderNet(kgt.GradientTrackingMixin, keras.Model):
    """keras-io collaborative filtering, as written there: `ops.tensordot(u, v, 2)`
    sums over the batch too."""

    def __init__(self, num_users: int, num_movies: int, embedding_size: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs: Any) -> Any:
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
        return ops.nn.sigmoid(dot_user_movie + user_bias + movie_bias)


class FixedRecommenderNet(RecommenderNet):
    """The same model with the dot product taken per example."""

    def call(self, inputs: Any) -> Any:
        user_vector = self.user_embedding(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        dot = ops.sum(user_vector * movie_vector, axis=-1, keepdims=True)
        biases = self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1])
        return ops.nn.sigmoid(dot + biases)


def ratings(count: int = 16) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([rng.integers(0, 10, count), rng.integers(0, 12, count)], axis=1)
    return x.astype("int32"), rng.uniform(size=(count, 1)).astype("float32")


def recommender(model_class: type = RecommenderNet) -> Any:
    model = model_class(10, 12, 8)
    model.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(1e-3))
    return model


def test_an_op_mixing_examples_is_refused_before_any_weight_changes(tmp_path: Path) -> None:
    model = recommender()
    x, y = ratings()
    model(x[:8])
    before = model.get_weights()
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match="mixes the examples of a batch") as refused:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    assert "ops.tensordot(u, v, 2)" in str(refused.value)
    assert "check_example_independence = False" in str(refused.value)
    assert int(model.optimizer.iterations.numpy()) == 0
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        model.gradient_statistics(x[:8], y[:8])


def test_the_guard_passes_a_fixed_model_and_can_be_switched_off(tmp_path: Path) -> None:
    x, y = ratings()
    fixed = recommender(FixedRecommenderNet)
    fixed.fit(x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "a.h5")])
    assert int(fixed.optimizer.iterations.numpy()) == 2
    assert_matches_oracle(
        fixed.gradient_statistics(x[:8], y[:8]), oracle_statistics(fixed, x[:8], y[:8])
    )

    unchecked = recommender()
    unchecked.check_example_independence = False
    unchecked.fit(
        x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "b.h5")]
    )
    assert int(unchecked.optimizer.iterations.numpy()) == 2
    with pytest.raises(TypeError, match="check_example_independence to be a bool"):
        unchecked.check_example_independence = "no"  # type: ignore[assignment]


class Counter(layers.Layer):
    """Counts its calls in a non-trainable variable, in inference mode too."""

    def build(self, input_shape: Any) -> None:
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs: Any) -> Any:
        self.calls.assign(self.calls + 1.0)
        return inputs


def counted(model_class: type) -> Any:
    inputs = keras.Input((4,))
    hidden = Counter(name="counter")(layers.Dense(5, activation="relu")(inputs))
    model = model_class(inputs, layers.Dense(3, name="head")(hidden))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_the_guard_leaves_states_and_metrics_as_they_were(tmp_path: Path) -> None:
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 3, size=16)
    tracked, plain = counted(kgt.GradientTrackingModel), counted(keras.Model)
    plain.set_weights(tracked.get_weights())
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    history = tracked.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    expected = plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert tracked.__dict__.get("_examples_independent"), "the guard did not run"
    assert float(tracked.get_layer("counter").calls.numpy()) == 2.0
    for got, want in zip(tracked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in expected.history:
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)


def test_the_guard_reads_the_metrics_of_several_losses_from_the_state(tmp_path: Path) -> None:
    """Two outputs with a loss each: Keras' compiled loss updates a metric per output
    (`kind_loss`, `size_loss`) as the guard computes the losses, and Keras' fit holds
    those metrics' values in the step's state, not in the variables. The guard passes
    and the fit is tracked (its statistics: tests/jax_backend/test_jax_several_outputs.py)."""
    inputs = keras.Input((4,))
    hidden = layers.Dense(5, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(
        inputs, {"kind": layers.Dense(3)(hidden), "size": layers.Dense(1)(hidden)}
    )
    model.compile(
        optimizer="sgd",
        loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
        loss_weights={"kind": 1.0, "size": 0.5},
    )
    x = rng.normal(size=(16, 4)).astype("float32")
    y = {"kind": rng.integers(0, 3, size=16), "size": rng.normal(size=(16, 1)).astype("float32")}
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[logger])
    assert model.__dict__.get("_examples_independent"), "the guard did not pass"
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert np.isfinite(log.per_example("grad_norm")).all()
        assert len(log.per_example("grad_norm")) == 16


def batch_centred_error(y_true: Any, y_pred: Any) -> Any:
    """A loss whose per-example values depend on the batch (through its mean)."""
    return ops.mean(ops.square(y_pred - ops.mean(y_pred, axis=0) - y_true), axis=-1)


def test_a_loss_mixing_examples_is_refused_too() -> None:
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((4,))
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=batch_centred_error)
    with pytest.raises(ValueError, match=r"mixes the examples.*loss 0 of the first 4"):
        model.gradient_statistics(x, y)


def test_the_guard_needs_no_tensorflow(tmp_path: Path) -> None:
    # As on a GPU machine without TensorFlow: any import of it fails.
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoTensorFlow(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ImportError(f"TensorFlow is not installed here: {name}")

        sys.meta_path.insert(0, NoTensorFlow())
        import keras, numpy as np
        import keras_gradtrack as kgt
        inputs = keras.Input((4,))
        centred = keras.layers.Lambda(lambda x: x - keras.ops.mean(x, axis=0))(inputs)
        model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(centred))
        model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
        try:
            model.fit(x, np.ones((8, 2), "float32"), batch_size=8, verbose=0,
                      callbacks=[kgt.HDF5GradientLogger(sys.argv[1])])
        except ValueError as error:
            assert "mixes the examples of a batch" in str(error), error
        else:
            raise AssertionError("not refused")
        assert int(model.optimizer.iterations.numpy()) == 0
        """
    )
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run.h5")],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience.seconds(2),
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_loop_of_train_on_batch_is_checked_once_per_model(monkeypatch: Any) -> None:
    checked: list[Any] = []

    def counted(model: Any, *args: Any) -> Any:
        checked.append(model)
        return original(model, *args)

    original = independence.find_example_mixing
    monkeypatch.setattr(independence, "find_example_mixing", counted)
    x, y = ratings()
    models = [recommender(), recommender(FixedRecommenderNet)]
    for model in models:
        model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        models[0].train_on_batch(x[:8], y[:8])
    assert int(models[0].optimizer.iterations.numpy()) == 0
    models[1].train_on_batch(x[:8], y[:8])
    assert models[1].__dict__.get("_examples_independent")
    models[1].train_on_batch(x[8:], y[8:])
    assert int(models[1].optimizer.iterations.numpy()) == 2
    assert checked == models


def test_a_later_fit_of_the_same_signature_skips_the_guard(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """As on TensorFlow: once per model, compiled loss and batch signature."""
    runs: list[int] = []

    def counted(model: Any, state: Any, x: Any, *args: Any) -> Any:
        runs.append(int(x.shape[0]))
        return original(model, state, x, *args)

    original = independence.find_example_mixing
    monkeypatch.setattr(independence, "find_example_mixing", counted)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    inputs = keras.Input((6,))
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))

    def fit(batch_size: int = 8, **kwargs: Any) -> None:
        logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", overwrite=True)
        model.fit(x, y, batch_size=batch_size, verbose=0, callbacks=[logger], **kwargs)

    fit()
    fit(batch_size=4)  # another batch size: the same signature
    assert runs == [8]
    fit(sample_weight=np.ones(32))  # sample weights: another signature
    assert runs == [8, 8]
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    fit()  # compiled again: checked again
    assert runs == [8, 8, 8]
