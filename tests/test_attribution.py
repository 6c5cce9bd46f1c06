"""Attribution: exact products with targets' gradients, sketches, influence, the CLI and plot.

Every number is checked against the oracle at the weights each step began with
(one tape per example and per target): `target_influence[i, j] = lr_t <g_i, g_j'>`
and `gradient_sketch[i] = R^T g_i C`, with the projections of the log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from layers_without_rule import NoRule
from oracle import (
    RTOL,
    oracle_sketches,
    oracle_target_products,
    per_example_gradients,
    target_gradients,
)

import keras_gradtrack as kgt
from keras_gradtrack import cli
from keras_gradtrack.attribution.sketches import projection_matrices
from keras_gradtrack.io import LogWriter
from keras_gradtrack.io.checkpoints import checkpoint_path, load_checkpoint

rng = np.random.default_rng(7)
BATCH = 8
TARGET_IDS = np.array([40, 41, 45])


class WeightsAtEachStep(keras.callbacks.Callback):
    """The weights each training step began with."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def compiled(inputs: Any, outputs: Any) -> Any:
    model = kgt.GradientTrackingModel(inputs, outputs)
    # The rate halves every step: each step's products must carry its own rate.
    rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model.compile(
        optimizer=keras.optimizers.SGD(rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def dense_model() -> Any:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    return compiled(inputs, keras.layers.Dense(3)(hidden))


def dense_sequence_model() -> Any:
    inputs = keras.Input((4, 5))
    hidden = keras.layers.Dense(6, activation="relu")(inputs)
    return compiled(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))


def conv_model() -> Any:
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(3, 3, padding="same", activation="relu")(inputs)
    hidden = keras.layers.Conv2D(4, 2, strides=2)(hidden)
    return compiled(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))


def embedding_model() -> Any:
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(7, 4)(inputs)  # 7 ids over 5 tokens: repeats
    hidden = keras.layers.Dense(6, activation="tanh")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return compiled(inputs, keras.layers.Dense(3)(pooled))


def layer_normalization_model() -> Any:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6)(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    hidden = NoRule()(hidden)  # no rule: the exact per-layer fallback
    return compiled(inputs, keras.layers.Dense(3)(hidden))


def recurrent_model() -> Any:
    inputs = keras.Input((4, 3))
    hidden = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))(inputs)
    hidden = keras.layers.GRU(4)(hidden)
    return compiled(inputs, keras.layers.Dense(3)(hidden))


MODELS = {
    "dense": (dense_model, (5,)),
    "recurrent": (recurrent_model, (4, 3)),
    "dense_sequence": (dense_sequence_model, (4, 5)),
    "conv": (conv_model, (6, 6, 2)),
    "embedding": (embedding_model, None),
    "layer_normalization": (layer_normalization_model, (5,)),
}


def data(shape: tuple[int, ...] | None, count: int) -> tuple[np.ndarray, np.ndarray]:
    if shape is None:
        x = rng.integers(0, 7, (count, 5)).astype("int32")
    else:
        x = rng.normal(size=(count, *shape)).astype("float32")
    return x, rng.integers(0, 3, count)


def fit_with_targets(
    model: Any, x: Any, y: Any, targets: Any, path: Path, sample_weight: Any = None, **logger: Any
) -> WeightsAtEachStep:
    weights = WeightsAtEachStep()
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[weights, kgt.HDF5GradientLogger(path, targets=targets, **logger)],
    )
    return weights


def at_weights(model: Any, weights: list[np.ndarray]) -> None:
    for variable, value in zip(model.trainable_variables, weights):
        variable.assign(value)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_target_influence_and_sketches_match_the_oracle_at_every_step(
    name: str, tmp_path: Path
) -> None:
    build, shape = MODELS[name]
    model = build()
    x, y = data(shape, 2 * BATCH)
    x_targets, y_targets = data(shape, len(TARGET_IDS))
    targets = ({"inputs": x_targets, "example_id": TARGET_IDS}, y_targets)
    path = tmp_path / "run.h5"
    # Sample weights are part of l_i (not of the targets' losses).
    sample_weights = rng.uniform(0.5, 2.0, len(y)).astype("float32")
    # dim 2 projects every side larger than 2: a real random projection.
    steps = fit_with_targets(model, {"inputs": x, "example_id": np.arange(16)}, y, targets, path,
                             sample_weight=sample_weights, sketch_dim=2, checkpoint_every=1)  # fmt: skip
    with kgt.GradientLog(path) as log:
        logged = log.per_example("target_influence")
        sketches = log.per_example("gradient_sketch")
        rates = log.per_step("learning_rate")
        assert log.layout.target_ids == tuple(TARGET_IDS)
        layout = log.layout.sketch
    np.testing.assert_allclose(rates, [0.1, 0.05])
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    matrices = projection_matrices(layout.dim, layout.seed, shapes)
    assert any(rows.shape[0] != rows.shape[1] for rows, _ in matrices)  # not all identities
    for step, weights in enumerate(steps.weights):
        at_weights(model, weights)
        rows = slice(step * BATCH, (step + 1) * BATCH)
        expected = oracle_target_products(
            model, x[rows], y[rows], sample_weights[rows], x_targets, y_targets
        )
        scale = np.abs(expected).max()
        np.testing.assert_allclose(
            logged[rows], rates[step] * expected, rtol=RTOL, atol=RTOL * rates[step] * scale
        )
        found = per_example_gradients(model, x[rows], y[rows], sample_weights[rows])
        gradients = np.concatenate(found["g"], axis=1)
        expected_sketches = oracle_sketches(gradients, shapes, matrices)
        np.testing.assert_allclose(
            sketches[rows],
            expected_sketches,
            rtol=RTOL,
            atol=RTOL * np.abs(expected_sketches).max(),
        )


def test_sketched_influence_of_targets_chosen_later_matches_the_oracle(tmp_path: Path) -> None:
    model = dense_model()
    x, y = data((5,), 3 * BATCH)
    later_x, later_y = data((5,), 2)
    path = tmp_path / "run.h5"
    steps = fit_with_targets(model, x, y, None, path, sketch_dim=3, checkpoint_every=2)
    fresh = dense_model()  # same architecture, other layer names and weights
    before = [np.array(w) for w in fresh.get_weights()]
    with kgt.GradientLog(path) as log:
        assert sorted(log.checkpoints()) == [0, 2]
        estimate = kgt.attribution.estimate_influence(log, fresh, (later_x, later_y))
        layout = log.layout.sketch
    for kept, now in zip(before, fresh.get_weights()):
        np.testing.assert_array_equal(kept, now)
    # Oracle: each step's sketches with the targets' sketches at its checkpoint (0, 0, 2).
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    matrices = projection_matrices(layout.dim, layout.seed, shapes)
    expected = np.zeros((3 * BATCH, 2))
    for step, rate in enumerate([0.1, 0.05, 0.025]):
        at_weights(model, steps.weights[2 if step == 2 else 0])
        target_sketches = oracle_sketches(
            target_gradients(model, later_x, later_y), shapes, matrices
        )
        at_weights(model, steps.weights[step])
        rows = slice(step * BATCH, (step + 1) * BATCH)
        gradients = np.concatenate(per_example_gradients(model, x[rows], y[rows])["g"], axis=1)
        expected[rows] = rate * oracle_sketches(gradients, shapes, matrices) @ target_sketches.T
    np.testing.assert_allclose(
        estimate.scores, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max()
    )
    assert estimate.method == "sketch (dim 3, 2 checkpoints)"
    np.testing.assert_array_equal(estimate.target_ids, [0, 1])


def test_sketches_without_projection_at_every_step_give_the_exact_scores(tmp_path: Path) -> None:
    model = dense_model()
    x, y = data((5,), 2 * BATCH)
    targets = data((5,), 3)
    # No side of any variable exceeds 8: the sketches are the gradients themselves.
    fit_with_targets(model, x, y, targets, tmp_path / "run.h5", sketch_dim=8, checkpoint_every=1)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        exact = log.influence()
        estimate = kgt.attribution.estimate_influence(log, dense_model(), targets)
    np.testing.assert_allclose(estimate.scores, exact.scores, rtol=RTOL, atol=1e-6)


def two_output_model() -> Any:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    first = keras.layers.Dense(3, name="first")(hidden)
    second = keras.layers.Dense(1, name="second")(hidden)
    model = kgt.GradientTrackingModel(inputs, [first, second])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        metrics=[["accuracy"], ["mae"]],
    )
    return model


def test_the_targets_change_neither_the_update_nor_the_metrics(tmp_path: Path) -> None:
    x, y = data((5,), 3 * BATCH)
    z = rng.normal(size=(len(x), 1)).astype("float32")
    x_targets, y_targets = data((5,), 4)
    targets = (x_targets, [y_targets, rng.normal(size=(4, 1)).astype("float32")])
    histories, weights = [], []
    for name, logger in (
        ("plain.h5", {}),
        ("targets.h5", {"targets": targets, "sketch_dim": 2, "checkpoint_every": 1}),
    ):
        keras.utils.set_random_seed(3)
        model = two_output_model()
        callback = kgt.HDF5GradientLogger(tmp_path / name, **logger)
        history = model.fit(x, [y, z], batch_size=BATCH, verbose=0, callbacks=[callback])
        histories.append(history.history)
        weights.append(model.get_weights())
    # The per-output loss trackers are the ones the targets' loss would also update.
    assert {"first_loss", "second_loss", "first_accuracy", "second_mae"} <= set(histories[0])
    assert histories[1] == histories[0]
    for plain, with_targets in zip(*weights):
        np.testing.assert_array_equal(with_targets, plain)
    with kgt.GradientLog(tmp_path / "targets.h5") as log:
        assert log.per_example("target_influence").shape == (3 * BATCH, 4)
        assert np.isfinite(log.per_example("target_influence")).all()


def write_influence_log(path: Path, targets: bool = True) -> None:
    """Two steps; example 5 in both, the targets' ids 30 and 31 (or a column `loss`)."""
    column = "target_influence" if targets else "loss"
    per_example = {column: 2 if targets else None}
    attrs = {"library_version": "0", "keras_version": "3", "tensorflow_version": "2"}
    writer = LogWriter(
        path, layer_names=["dense"], per_example=per_example, per_step={"learning_rate": None},
        attrs={**attrs, "model_name": "m"}, target_ids=[30, 31] if targets else (),
    )  # fmt: skip
    with writer:
        for step, (ids, products) in enumerate(
            (
                ([5, 6, 7], [[1.0, -2.0], [0.5, 0.5], [-3.0, 0.0]]),
                ([8, 5], [[2.0, 2.0], [1.5, -1.0]]),
            )
        ):
            values = np.array(products) if targets else np.array(products)[:, 0]
            writer.write_step(
                step=step, epoch=0, example_ids=ids, per_example={column: values},
                per_step={"learning_rate": 0.1},
            )  # fmt: skip


def test_influence_sums_each_examples_rows_and_ranks_them(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    write_influence_log(path)
    with kgt.GradientLog(path) as log:
        influence = log.influence()
    np.testing.assert_array_equal(influence.train_ids, [5, 6, 7, 8])
    np.testing.assert_array_equal(influence.target_ids, [30, 31])
    np.testing.assert_allclose(influence.scores, [[2.5, -3.0], [0.5, 0.5], [-3.0, 0.0], [2, 2]])
    np.testing.assert_array_equal(influence.rows, [2, 1, 1, 1])
    assert influence.proponents(30, k=2).example_id.tolist() == [5, 8]
    assert influence.opponents(30, k=2).example_id.tolist() == [7, 6]
    np.testing.assert_allclose(influence.opponents(31, k=2).score, [-3.0, 0.0])
    frame = influence.to_pandas()
    assert frame.loc[5, 31] == -3.0 and list(frame.columns) == [30, 31]
    with pytest.raises(KeyError, match=r"Expected one of the target ids \[30, 31\]"):
        influence.proponents(5)


def test_cli_influence_lists_proponents_and_opponents(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "run.h5"
    write_influence_log(path)
    assert cli.main(["influence", str(path), "--target", "31", "-k", "2"]) == 0
    out = capsys.readouterr().out
    proponents, opponents = out.split("\n\n")
    assert proponents.splitlines()[0] == "target 31, proponents:"
    assert [line.split()[1] for line in proponents.splitlines()[3:]] == ["8", "6"]
    assert [line.split()[1] for line in opponents.splitlines()[3:]] == ["5", "7"]
    assert cli.main(["influence", str(path), "--target", "99"]) == 1
    assert "Expected one of the target ids" in capsys.readouterr().err


def test_a_log_without_targets_says_how_to_get_influence(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    write_influence_log(path, targets=False)
    x, y = data((5,), BATCH)
    with kgt.GradientLog(path) as log:
        with pytest.raises(KeyError, match=r"Pass targets=\(x, y\) to HDF5GradientLogger"):
            log.influence()
        with pytest.raises(KeyError, match="written without sketch_dim"):
            kgt.attribution.estimate_influence(log, dense_model(), (x, y))


def test_a_version_1_log_still_reads(tmp_path: Path) -> None:
    """A log as schema version 1 wrote it, made with plain h5py."""
    path = tmp_path / "v1.h5"
    with h5py.File(path, "w") as file:
        file.attrs.update(
            schema_version=1, library_version="0.1.0", keras_version="3", tensorflow_version="2",
            created="2025-01-01T00:00:00+00:00", model_name="m",
        )  # fmt: skip
        file.create_group("layers").attrs["names"] = np.array(["dense"], dtype=h5py.string_dtype())
        for table, columns in (
            ("per_example", {"step": [0, 0], "epoch": [0, 0], "example_id": [3, 4]}),
            ("per_step", {"step": [0], "epoch": [0], "batch_size": [2]}),
        ):
            for name, values in columns.items():
                file[f"{table}/{name}"] = np.array(
                    values, np.int64 if name != "epoch" else np.int32
                )
        file["per_example/grad_norm"] = np.array([1.0, 2.0], np.float32)
        file["per_step/learning_rate"] = np.array([0.5], np.float32)
    with kgt.GradientLog(path) as log:
        assert log.attrs["schema_version"] == 1
        assert log.layout.target_ids == () and log.layout.sketch is None
        np.testing.assert_allclose(log.self_influence().score, [0.5, 2.0])
        with pytest.raises(KeyError, match="written without targets"):
            log.influence()


def test_appending_with_other_targets_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    x, y = data((5,), BATCH)
    model = dense_model()
    model.fit(x, y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, targets=(x[:2], y[:2]))])
    before = [w.copy() for w in model.get_weights()]
    other = kgt.HDF5GradientLogger(
        path, append=True, targets=({"x": x[:2], "example_id": [5, 6]}, y[:2])
    )
    with pytest.raises(
        ValueError,
        match=r"its target_ids differ. Expected \(in the file\): \(0, 1\). Received: target_ids=\(5, 6\)",
    ):
        model.fit(x, y, verbose=0, callbacks=[other])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        ((np.zeros((3, 5)), np.zeros(2)), r"one row per target.*Received lengths: \[2, 3\]"),
        (({"x": np.zeros((2, 5)), "example_id": [4, 4]}, np.zeros(2)), "one distinct `example_id`"),
        (({"x": np.zeros((2, 5)), "example_id": ["a", "b"]}, np.zeros(2)), "integer per example"),
        (np.zeros((2, 5)), r"Expected targets=\(x, y\)"),
    ],
)
def test_bad_targets_are_refused_when_the_logger_is_made(targets: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kgt.HDF5GradientLogger("unused.h5", targets=targets)


def test_statistics_may_not_take_the_attribution_columns_names() -> None:
    class Named(kgt.statistics.Statistic):
        name = "target_influence"

        def compute(self, primitives: Any) -> Any:
            return primitives.loss

    with pytest.raises(ValueError, match="other than the log's own columns"):
        kgt.HDF5GradientLogger("unused.h5", statistics=[Named()])


class OwnLoss(kgt.GradientTrackingMixin, keras.Model):
    """A model whose step makes its own per-example losses: no compiled loss."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            per_example = tf.square(self(x)[:, 0] - y)
            loss = tf.reduce_mean(per_example)
        gradients = self.tracked_gradient(
            tape, loss, self.trainable_weights, per_example_loss=per_example
        )
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        return {"loss": loss}


def test_targets_need_a_compiled_loss_and_say_so_before_training(tmp_path: Path) -> None:
    model = OwnLoss()
    model.compile(optimizer="sgd")
    x, y = data((5,), BATCH)
    model(x[:1])
    before = [w.copy() for w in model.get_weights()]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", targets=(x[:2], y[:2].astype("float32")))
    with pytest.raises(ValueError, match="compile the model with `loss=`"):
        model.fit(x, y.astype("float32"), verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_checkpoints_are_numbered_as_the_log_and_kept_apart(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    x, y = data((5,), 3 * BATCH)
    model = dense_model()
    # With sketches and no checkpoint_every: the first step of every epoch.
    logger = kgt.HDF5GradientLogger(path, sketch_dim=2)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[logger])
    with kgt.GradientLog(path) as log:
        assert sorted(log.checkpoints()) == [0, 3]
    appended = kgt.HDF5GradientLogger(path, sketch_dim=2, append=True, checkpoint_every=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[appended])
    with kgt.GradientLog(path) as log:
        assert sorted(log.checkpoints()) == [0, 3, 6, 8]
        np.testing.assert_array_equal(log.per_step("step"), np.arange(9))
    # Step 6 began with the weights the first fit ended with; step 8 with later ones.
    for step in (6, 8):
        saved = dense_model()
        load_checkpoint(saved, checkpoint_path(path, step))
        ended_with = saved.get_weights()[0]
    assert not np.allclose(ended_with, model.get_weights()[0])
    (tmp_path / "run.h5").unlink()
    with pytest.raises(FileExistsError, match="holds checkpoints of another log"):
        model.fit(x, y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, sketch_dim=2)])
    fresh = kgt.HDF5GradientLogger(path, sketch_dim=2, overwrite=True)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[fresh])
    with kgt.GradientLog(path) as log:
        assert sorted(log.checkpoints()) == [0]


def test_two_replicas_log_what_one_device_logs(
    tmp_path: Path, two_cpu_strategy: tf.distribute.MirroredStrategy
) -> None:
    x, y = data((5,), 2 * BATCH)
    x_targets, y_targets = data((5,), 3)
    with two_cpu_strategy.scope():
        distributed = dense_model()
    single = dense_model()
    single.set_weights(distributed.get_weights())
    for model, name in ((single, "single.h5"), (distributed, "mirrored.h5")):
        logger = kgt.HDF5GradientLogger(
            tmp_path / name, targets=(x_targets, y_targets), sketch_dim=2
        )
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[logger])
    with (
        kgt.GradientLog(tmp_path / "single.h5") as one,
        kgt.GradientLog(tmp_path / "mirrored.h5") as two,
    ):
        for name in ("target_influence", "gradient_sketch"):
            np.testing.assert_allclose(
                two.per_example(name), one.per_example(name), rtol=1e-4, atol=1e-6
            )


def test_the_plot_shows_each_target_beside_its_proponents_and_opponents(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from keras_gradtrack import plots

    path = tmp_path / "run.h5"
    write_influence_log(path)
    with kgt.GradientLog(path) as log:
        influence = log.influence()
    images = rng.random((10, 16))
    figure = plots.plot_proponents_and_opponents(
        influence, [30, 31], images, np.arange(10) % 3, rng.random((32, 4, 4)),
        target_labels=np.zeros(32, int), predicted=np.ones(32, int), k=2, highlight=[5],
    )  # fmt: skip
    rows = np.array(figure.axes).reshape(2, 5)
    assert rows[0, 0].get_title() == "target 30\nlabel 0, pred 1"
    assert [axes.get_title() for axes in rows[0, 1:]] == [
        "5*: 2\n+2.5", "8: 2\n+2", "7: 1\n-3", "6: 0\n+0.5",
    ]  # fmt: skip
    assert rows[1, 3].get_title().startswith("5*")  # the lowest on target 31
    assert rows[0, 1].images[0].get_array().shape == (4, 4)


@pytest.mark.parametrize("variant", ["mixed_float16", "jit_compile"])
def test_products_under_mixed_precision_and_xla_match_the_float32_oracle(
    variant: str, tmp_path: Path
) -> None:
    x, y = data((5,), BATCH)
    x_targets, y_targets = data((5,), 3)
    reference = dense_model()
    expected = 0.1 * oracle_target_products(reference, x, y, None, x_targets, y_targets)
    if variant == "mixed_float16":
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(6, activation="tanh")(inputs)
        model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3, dtype="float32")(hidden))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=variant == "jit_compile",
    )
    model.set_weights(reference.get_weights())
    fit_with_targets(model, x, y, (x_targets, y_targets), tmp_path / "run.h5")
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = log.per_example("target_influence")
    # float16 keeps 11 significant bits; the loss scale is divided out.
    rtol = 1e-2 if variant == "mixed_float16" else RTOL
    np.testing.assert_allclose(logged, expected, rtol=rtol, atol=rtol * np.abs(expected).max())
