"""Training through `fit`: the update equals Keras', the log holds what the oracle says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(3)


def mlp(cls: type = kgt.GradientTrackingModel, features: int = 10, classes: int = 4) -> Any:
    inputs = keras.Input((features,), name="pixels")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    outputs = keras.layers.Dense(classes)(hidden)
    model = cls(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def classification_data(n: int = 50, features: int = 10, classes: int = 4) -> tuple[Any, Any]:
    return rng.normal(size=(n, features)).astype("float32"), rng.integers(0, classes, n)


def test_weight_updates_equal_plain_keras_over_epochs_with_adam(tmp_path: Path) -> None:
    x, y = classification_data(50)
    weights = rng.uniform(0.5, 1.5, 50).astype("float32")
    plain = mlp(keras.Model)
    tracked = mlp()
    tracked.set_weights(plain.get_weights())
    fit_args = dict(sample_weight=weights, batch_size=16, epochs=3, shuffle=False, verbose=0)
    plain_history = plain.fit(x, y, **fit_args)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", every_n_steps=2)
    tracked_history = tracked.fit(x, y, callbacks=[logger], **fit_args)
    for expected, actual in zip(plain.get_weights(), tracked.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        tracked_history.history["loss"], plain_history.history["loss"], rtol=1e-5
    )
    assert set(tracked_history.history) == set(plain_history.history)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        # 4 steps per epoch (16+16+16+2), every second one tracked: steps 0, 2 of each epoch.
        assert log.per_step("step").tolist() == [0, 2, 4, 6, 8, 10]
        assert log.per_step("batch_size").tolist() == [16, 16] * 3


def test_the_step_is_traced_once_with_the_optimizer_keras_would_build(tmp_path: Path) -> None:
    # Keras builds the optimizer inside the first trace of the step, and tf.function
    # then traces the step again; the tracked model builds it before, so once.
    x, y = classification_data(32)
    plain = mlp(keras.Model)
    tracked = mlp()
    tracked.set_weights(plain.get_weights())
    traces = []
    step = tracked._tracked_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        traces.append(1)
        return step(*args, **kwargs)

    tracked._tracked_step = counted
    fit_args = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    plain.fit(x, y, **fit_args)
    tracked.fit(x, y, callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")], **fit_args)
    assert len(traces) == 1

    # The same optimizer state as Keras builds: variables, their paths, their values.
    def paths(model: Any) -> list[str]:
        # Adam's slots are named after their weights' paths, and the models' layers differ
        # in name only: number the weights instead.
        names = {
            w.path.replace("/", "_"): f"weight{i}" for i, w in enumerate(model.trainable_weights)
        }
        paths = [v.path.split("/", 1)[1] for v in model.optimizer.variables]
        for name, number in sorted(names.items(), key=lambda item: -len(item[0])):
            paths = [path.replace(name, number) for path in paths]
        return paths

    assert paths(tracked) == paths(plain)
    assert paths(tracked)[:4] == [
        "iteration",
        "learning_rate",
        "weight0_momentum",
        "weight0_velocity",
    ]
    for expected, actual in zip(plain.optimizer.variables, tracked.optimizer.variables):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-7)
    for expected, actual in zip(plain.get_weights(), tracked.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_custom_train_step_builds_its_optimizers_itself(tmp_path: Path) -> None:
    # A step of its own may hand the optimizer other variables: left to build it.
    class FirstLayerOnly(kgt.GradientTrackingModel):
        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            variables = self.layers[1].trainable_weights
            gradients = self.tracked_gradient(tape, loss, variables)
            self.optimizer.apply_gradients(zip(gradients, variables))
            return {"loss": loss}

    inputs = keras.Input((10,))
    outputs = keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(inputs))
    model = FirstLayerOnly(inputs, outputs)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = classification_data(16)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "r.h5")])
    # Adam's two slots for the first Dense's kernel and bias only, as Keras builds them.
    assert len(model.optimizer.variables) == 2 + 2 * 2


class ExpGain(keras.layers.Layer):
    """`x * exp(w)` per feature: no rule covers it, and its gradient `x * exp(w)` depends on w."""

    def build(self, input_shape: Any) -> None:
        self.log_gain = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

    def call(self, inputs: Any) -> Any:
        return inputs * keras.ops.exp(self.log_gain)


def mlp_with_fallback_layer() -> Any:
    """The fallback re-runs ExpGain in the step, reading its weights."""
    inputs = keras.Input((10,), name="pixels")
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    hidden = ExpGain()(hidden)
    outputs = keras.layers.Dense(4)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("build", [mlp, mlp_with_fallback_layer], ids=["rules", "fallback"])
def test_logged_rows_match_the_oracle_step_by_step(tmp_path: Path, build: Any) -> None:
    """Each tracked step of a multi-step fit (ragged last batch) equals the oracle at the
    weights before that step's update (a large learning rate makes any mix-up visible)."""
    x, y = classification_data(22)
    weights = rng.uniform(0.0, 2.0, 22).astype("float32")
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=model.loss)
    expected = []

    class Oracle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rows = slice(batch * 8, batch * 8 + 8)
            expected.append(oracle_statistics(model, x[rows], y[rows], weights[rows]))

    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", flush_every=2)
    model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=8,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Oracle(), logger],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        steps = log.per_example("step")
        assert log.num_examples == 22
        np.testing.assert_array_equal(log.per_example("example_id"), np.arange(22))
        for step, oracle in enumerate(expected):
            rows = steps == step
            logged = {name: log.per_example(name)[rows] for name in log.per_example_names}
            logged.update({name: log.per_step(name)[step] for name in log.per_step_names})
            assert_matches_oracle(logged, oracle)
        assert log.per_step("batch_size").tolist() == [8, 8, 6]


def test_example_ids_follow_shuffled_numpy_and_tf_data_inputs(tmp_path: Path) -> None:
    x, y = classification_data(40)
    ids = np.arange(1000, 1040)
    model = mlp()
    logger = kgt.HDF5GradientLogger(tmp_path / "numpy.h5")
    model.fit(
        {"pixels": x, "example_id": ids},
        y,
        batch_size=16,
        epochs=2,
        shuffle=True,
        verbose=0,
        callbacks=[logger],
    )
    dataset = tf.data.Dataset.from_tensor_slices(({"pixels": x, "example_id": ids}, y))
    logger_tf = kgt.HDF5GradientLogger(tmp_path / "tfdata.h5")
    model.fit(
        dataset.shuffle(40, seed=1).batch(16),
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[logger_tf],
    )
    with kgt.GradientLog(tmp_path / "numpy.h5") as log:
        logged = log.per_example("example_id")
        epochs = log.per_example("epoch")
        for epoch in (0, 1):
            assert sorted(logged[epochs == epoch].tolist()) == ids.tolist()
        assert logged[epochs == 0].tolist() != ids.tolist()  # shuffled
        # The loss logged for an id is that example's loss, wherever it landed.
        first_step = log.per_example("step") == 0
    with kgt.GradientLog(tmp_path / "tfdata.h5") as log:
        assert sorted(log.per_example("example_id").tolist()) == ids.tolist()
    assert first_step.sum() == 16


def test_ids_pair_with_the_right_examples() -> None:
    x, y = classification_data(12)
    model = mlp()
    ids = np.arange(500, 512)
    permutation = rng.permutation(12)
    direct = model.gradient_statistics(x, y)
    shuffled = model.gradient_statistics(
        {"pixels": x[permutation], "example_id": ids[permutation]}, y[permutation]
    )
    order = np.argsort(shuffled["example_id"])
    np.testing.assert_allclose(shuffled["loss"][order], direct["loss"], rtol=1e-5)
    np.testing.assert_allclose(shuffled["grad_norm"][order], direct["grad_norm"], rtol=1e-5)


def test_evaluate_and_predict_accept_example_ids() -> None:
    x, y = classification_data(20)
    model = mlp()
    with_ids = {"pixels": x, "example_id": np.arange(20)}
    np.testing.assert_allclose(model.predict(with_ids, verbose=0), model.predict(x, verbose=0))
    assert model.evaluate(with_ids, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    x, y = classification_data(20)
    model = mlp()
    model.fit(x, y, epochs=1, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "a.h5")])
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, kgt.GradientTrackingModel)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    loaded.fit(x, y, epochs=1, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "b.h5")])
    with kgt.GradientLog(tmp_path / "b.h5") as log:
        assert log.num_examples == 20
        assert log.layers == model.tracked_layer_names


class MixinClassifier(kgt.GradientTrackingMixin, keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def test_mixin_on_an_unbuilt_subclassed_model_logs(tmp_path: Path) -> None:
    x, y = classification_data(30, classes=3)
    model = MixinClassifier()
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(
        x,
        y,
        batch_size=10,
        epochs=1,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.layers == ["dense", "dense_1"] or len(log.layers) == 2
        assert log.per_example("layer_grad_norm").shape == (30, 2)
        assert np.all(np.isfinite(log.per_example("cosine")))


def test_logs_history_and_progress_bar_stay_scalar(tmp_path: Path) -> None:
    x, y = classification_data(20)
    model = mlp()
    seen: list[dict[str, Any]] = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append(dict(logs))

    history = model.fit(
        x,
        y,
        batch_size=5,
        epochs=1,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5"), Spy()],
    )
    assert set(seen[0]) == {"loss", "accuracy"}
    assert all(np.ndim(value) == 0 for logs in seen for value in logs.values())
    assert set(history.history) == {"loss", "accuracy"}


def test_file_follows_schema_version_2(tmp_path: Path) -> None:
    x, y = classification_data(20)
    model = mlp()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert f.attrs["schema_version"] == 2
        for key in (
            "library_version",
            "keras_version",
            "tensorflow_version",
            "created",
            "model_name",
        ):
            assert key in f.attrs
        assert list(f["layers"].attrs["names"]) == model.tracked_layer_names
        assert f["per_example/step"].dtype == np.int64
        assert f["per_example/epoch"].dtype == np.int32
        assert f["per_example/example_id"].dtype == np.int64
        assert f["per_step/batch_size"].dtype == np.int32
        assert f["per_example/layer_grad_norm"].shape == (40, 3)
        assert f["per_example/cosine"].dtype == np.float32
        assert f["per_example/cosine"].maxshape == (None,)
        assert f["per_example/cosine"].chunks is not None
        assert f["per_example/cosine"].compression == "gzip"
        assert f["per_step/gradient_diversity"].shape == (6,)
        assert f["per_step/step"][:].tolist() == list(range(6))


def test_functional_and_subclassed_construction_coexist() -> None:
    class Functionalish(kgt.GradientTrackingModel):
        pass

    class Subclassed(kgt.GradientTrackingModel):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.dense(x)

    inputs = keras.Input((3,))
    functional = Functionalish(inputs, keras.layers.Dense(2)(inputs))
    subclassed = Subclassed()
    subclassed(np.zeros((1, 3), "float32"))
    assert isinstance(functional, Functionalish) and isinstance(subclassed, Subclassed)
    assert type(functional).__name__ == "Functionalish"
    assert subclassed.tracked_layer_names == ["dense"] or len(subclassed.tracked_layer_names) == 1


def test_jit_compiled_fit_is_exact(tmp_path: Path) -> None:
    x, y = classification_data(16)
    model = mlp()
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    assert model.jit_compile
    expected = oracle_statistics(model, x, y)
    model.fit(
        x,
        y,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = {name: log.per_example(name) for name in log.per_example_names}
        logged.update({name: log.per_step(name)[0] for name in log.per_step_names})
    assert_matches_oracle(logged, expected)


def test_the_learning_rate_of_each_tracked_step_is_logged(tmp_path: Path) -> None:
    x, y = classification_data(40)
    model = mlp()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model.compile(
        optimizer=keras.optimizers.SGD(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        x,
        y,
        batch_size=10,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5", every_n_steps=2)],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        np.testing.assert_allclose(log.per_step("learning_rate"), [0.1, 0.025], rtol=1e-6)
