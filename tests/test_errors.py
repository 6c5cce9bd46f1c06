"""Bad input gets a clear error, raised before any weight changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(11)
X = rng.normal(size=(16, 6)).astype("float32")
Y = rng.integers(0, 3, 16)


def small_model(*extra_layers: Any, cls: type = kgt.GradientTrackingModel) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    for layer in extra_layers:
        hidden = layer(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = cls(inputs, outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def fit_fails_without_touching_weights(model: Any, callback: Any, error: type, match: str) -> None:
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_unknown_statistic_lists_the_valid_names_at_construction(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"Expected one of \[.*'cosine'.*\] or a .*Received: 'cosin'"
    ):
        kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["cosin"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"append": True, "overwrite": True}, "at most one of `append` and `overwrite`"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"flush_every": -1}, "flush_every"),
        ({"flush_seconds": -0.5}, "flush_seconds"),
        ({"statistics": "cosine"}, "must be a list"),
        ({"statistics": ["cosine", "cosine"]}, "duplicates"),
        ({"statistics": ["pairwise_cosine"]}, "gradient_statistics"),
    ],
)
def test_bad_logger_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        kgt.HDF5GradientLogger(tmp_path / "run.h5", **kwargs)


def test_existing_file_is_refused_before_training(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    path.write_bytes(b"precious")
    logger = kgt.HDF5GradientLogger(path)
    fit_fails_without_touching_weights(small_model(), logger, FileExistsError, "overwrite=True")
    assert path.read_bytes() == b"precious"


def test_overwrite_replaces_and_append_continues(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    path.write_bytes(b"old")
    model = small_model()
    model.fit(
        X, Y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, overwrite=True)]
    )
    model.fit(X, Y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, append=True)])
    with kgt.GradientLog(path) as log:
        assert log.per_step("step").tolist() == [0, 1, 2, 3]
        assert log.num_examples == 32


def test_reusing_a_logger_continues_its_file(tmp_path: Path) -> None:
    model = small_model()
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(X, Y, batch_size=8, verbose=0, callbacks=[logger])
    model.fit(X, Y, batch_size=8, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.per_step("step").tolist() == [0, 1, 2, 3]


def test_append_to_another_models_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    small_model().fit(X, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    other = small_model(keras.layers.Dense(4))
    fit_fails_without_touching_weights(
        other, kgt.HDF5GradientLogger(path, append=True), ValueError, "layer"
    )


def test_missing_directory_is_refused_before_training(tmp_path: Path) -> None:
    logger = kgt.HDF5GradientLogger(tmp_path / "missing" / "run.h5")
    fit_fails_without_touching_weights(small_model(), logger, FileNotFoundError, "missing")


def test_plain_keras_model_is_refused(tmp_path: Path) -> None:
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    fit_fails_without_touching_weights(
        small_model(cls=keras.Model), logger, TypeError, "GradientTrackingModel"
    )


def test_batch_normalization_in_training_is_refused_naming_the_opt_in_and_the_alternatives(
    tmp_path: Path,
) -> None:
    model = small_model(keras.layers.BatchNormalization())
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    opt_in = r"model\.track_batch_normalization = True"
    fit_fails_without_touching_weights(model, logger, ValueError, opt_in)
    assert not (tmp_path / "run.h5").exists()
    with pytest.raises(ValueError) as refused:
        model.gradient_tracking_plan()
    message = str(refused.value)
    for advice in ("costs about", "layer.trainable = False", "kgt.convert_to_group_normalization"):
        assert advice in message


def test_frozen_batch_normalization_is_fine(tmp_path: Path) -> None:
    norm = keras.layers.BatchNormalization()
    model = small_model(norm)
    norm.trainable = False
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    moving_mean = keras.ops.convert_to_numpy(norm.moving_mean)
    expected = oracle_statistics(model, X, Y)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    model.fit(X, Y, batch_size=len(X), shuffle=False, verbose=0, callbacks=[logger])
    # Frozen, the layer normalizes with its moving moments and leaves them alone.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(norm.moving_mean), moving_mean)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = {name: log.per_example(name) for name in log.per_example_names}
        logged.update({name: log.per_step(name)[0] for name in log.per_step_names})
    assert_matches_oracle(logged, expected)


def test_model_without_trainable_weights_is_refused(tmp_path: Path) -> None:
    model = small_model()
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="no trainable weights"):
        model.fit(X, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")])


def test_steps_per_execution_above_one_on_several_replicas_is_refused(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    with two_cpu_strategy.scope():
        model = small_model()
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=2,
        )
    assert any("one replica only" in r for r in kgt.check(model).refusals)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    fit_fails_without_touching_weights(model, logger, ValueError, "one replica only")


class IgnoresSampleWeights(kgt.GradientTrackingModel):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):  # type: ignore[no-untyped-def]
        return tf.reduce_mean(tf.square(y_pred - tf.cast(tf.one_hot(y, 3), y_pred.dtype)))


def test_loss_that_cannot_be_split_per_example_is_refused(tmp_path: Path) -> None:
    inputs = keras.Input((6,))
    model = IgnoresSampleWeights(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd")
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    fit_fails_without_touching_weights(model, logger, ValueError, "cannot be told apart")


def test_activity_regularization_is_refused(tmp_path: Path) -> None:
    model = small_model(keras.layers.ActivityRegularization(l2=0.1))
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    fit_fails_without_touching_weights(model, logger, ValueError, "has an activity regularizer")


class TiedProjection(keras.layers.Layer):
    """Projects with the transpose of another layer's kernel (weight tying)."""

    def __init__(self, source: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source

    def call(self, x: Any) -> Any:
        return keras.ops.matmul(x, keras.ops.transpose(self.source.kernel))


@pytest.mark.parametrize("sequence", [False, True], ids=["direct_rule", "materialized_rule"])
def test_tied_weights_are_refused_before_training(tmp_path: Path, sequence: bool) -> None:
    """A variable read outside its layer would get per-example gradients (and, for a
    materialized layer, a batch gradient) missing that use: refused, not wrong."""
    shape = (7, 6) if sequence else (6,)
    inputs = keras.Input(shape)
    encoder = keras.layers.Dense(4, activation="tanh")
    outputs = TiedProjection(encoder)(encoder(inputs))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(8, *shape)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match="tied weights"):
        model.fit(x, x, batch_size=8, verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    with pytest.raises(ValueError, match=f"{encoder.name}/kernel"):
        model.gradient_statistics(x, x)
    model.fit(x, x, batch_size=8, verbose=0)  # untracked steps are plain Keras


class RowByRow(keras.layers.Layer):
    """Applies a Dense layer to each example in a `tf.map_fn` loop."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4)

    def build(self, input_shape: Any) -> None:
        self.inner.build((1, input_shape[-1]))

    def call(self, inputs: Any) -> Any:
        return tf.map_fn(lambda row: self.inner(row[None])[0], inputs)


def test_a_layer_called_inside_a_loop_is_refused_with_advice(tmp_path: Path) -> None:
    """Its inputs exist only inside the loop (Keras' recurrent layers are tracked whole)."""
    model = small_model(RowByRow())
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    fit_fails_without_touching_weights(model, logger, ValueError, "inside a loop.*keras.layers.RNN")


def test_a_user_statistic_from_the_primitives_lands_in_the_file(tmp_path: Path) -> None:
    class MaxLayerNorm(kgt.statistics.Statistic):
        name = "max_layer_grad_norm"

        def compute(self, primitives: Any) -> Any:
            return tf.sqrt(tf.reduce_max(primitives.sq_norm, axis=1))

    class LayerAlignment(kgt.statistics.Statistic):
        name = "layer_alignment"
        per_example = False
        per_layer = True

        def compute(self, primitives: Any) -> Any:
            return tf.reduce_mean(primitives.dot, axis=0)

    model = small_model()
    logger = kgt.HDF5GradientLogger(
        tmp_path / "run.h5", statistics=["layer_grad_norm", MaxLayerNorm(), LayerAlignment()]
    )
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        np.testing.assert_allclose(
            log.per_example("max_layer_grad_norm"),
            log.per_example("layer_grad_norm").max(axis=1),
            rtol=1e-6,
        )
        assert log.per_step("layer_alignment").shape == (2, 2)
        assert "cosine" not in log.per_example_names


@pytest.mark.parametrize(
    "ids", [np.arange(16, dtype="float32"), np.arange(32).reshape(16, 2)], ids=["float", "2-D"]
)
def test_example_ids_of_the_wrong_dtype_or_shape_are_refused(tmp_path: Path, ids: Any) -> None:
    inputs = keras.Input((6,), name="pixels")
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="one integer per example"):
        model.fit(
            {"pixels": X, "example_id": ids},
            Y,
            batch_size=8,
            verbose=0,
            callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
        )
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_example_ids_of_the_wrong_length_are_refused() -> None:
    inputs = keras.Input((6,), name="pixels")
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="size"):
        model.fit({"pixels": X, "example_id": np.arange(15)}, Y, verbose=0)
