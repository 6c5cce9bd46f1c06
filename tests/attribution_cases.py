"""Attribution on a probed engine (JAX, PyTorch): `HDF5GradientLogger(targets=...,
sketch_dim=...)` against the backend's own oracle; each backend's test module imports
these.

Every number is checked against the gradient of each example's loss alone and of each
target's (inference mode) at the weights each step began with:
`target_influence[i, j] = lr_t <g_i, g_j'>` and `gradient_sketch[i] = R^T g_i C`,
with the projections of the log (the same definition as on TensorFlow).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS, ChannelScale, head
from sketch_oracle import oracle_sketches
from tolerance import RTOL
from without_tensorflow import run_without_tensorflow

import keras_gradtrack as kgt
from keras_gradtrack.engine.attribution_requests import projection_matrices

oracle = importlib.import_module(f"{keras.backend.backend()}_oracle")
per_example_gradients, target_gradients = oracle.per_example_gradients, oracle.target_gradients

BATCH = 8
TARGET_IDS = np.array([40, 41, 45])


class WeightsAtEachStep(keras.callbacks.Callback):
    """The weights each training step began with."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.weights.append([keras.ops.convert_to_numpy(v) for v in self.model.trainable_variables])


def compiled(model: Any) -> Any:
    # The rate halves every step: each step's products must carry its own rate.
    rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model.compile(
        optimizer=keras.optimizers.SGD(rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def tokens(model_class: type) -> Any:
    """Embedding (repeated ids), a Dense layer called twice, a layer of one's own on the
    fallback."""
    inputs = keras.Input((5,), dtype="int32")
    shared = keras.layers.Dense(4, activation="tanh")
    hidden = shared(shared(keras.layers.Embedding(7, 4)(inputs)))
    hidden = ChannelScale()(keras.layers.GlobalAveragePooling1D()(hidden))
    return head(model_class, inputs, hidden)


BUILDERS = {name: MODELS[name] for name in ("mlp", "cnn", "transformer_block")}
BUILDERS["tokens"] = (tokens, None)


def data(rng: np.random.Generator, shape: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    if shape is None:
        x = rng.integers(0, 7, (count, 5)).astype("int32")
    else:
        x = rng.normal(size=(count, *shape)).astype("float32")
    return x, rng.integers(0, 3, count)


def at_weights(model: Any, weights: list[np.ndarray]) -> None:
    for variable, value in zip(model.trainable_variables, weights):
        variable.assign(value)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_target_influence_and_sketches_match_the_oracle_at_every_step(
    name: str, tmp_path: Path
) -> None:
    build, shape = BUILDERS[name]
    assert_matches_the_oracle_at_every_step(
        compiled(build(kgt.GradientTrackingModel)), shape, tmp_path
    )


def assert_matches_the_oracle_at_every_step(model: Any, shape: Any, tmp_path: Path) -> None:
    """Two logged steps with targets and sketches: each row is the oracle's."""
    rng = np.random.default_rng(7)
    x, y = data(rng, shape, 2 * BATCH)
    x_targets, y_targets = data(rng, shape, len(TARGET_IDS))
    targets = ({"inputs": x_targets, "example_id": TARGET_IDS}, y_targets)
    # Sample weights are part of l_i (not of the targets' losses).
    sample_weights = rng.uniform(0.5, 2.0, len(y)).astype("float32")
    path = tmp_path / "run.h5"
    steps = WeightsAtEachStep()
    # dim 2 projects every side larger than 2: a real random projection.
    logger = kgt.HDF5GradientLogger(
        path, targets=targets, sketch_dim=2, checkpoint_every=1, overwrite=True
    )
    model.fit({"inputs": x, "example_id": np.arange(2 * BATCH)}, y, sample_weight=sample_weights,
              batch_size=BATCH, shuffle=False, verbose=0, callbacks=[steps, logger])  # fmt: skip
    with kgt.GradientLog(path) as log:
        logged = log.per_example("target_influence")
        sketches = log.per_example("gradient_sketch")
        rates = log.per_step("learning_rate")
        assert log.layout.target_ids == tuple(TARGET_IDS)
        layout = log.layout.sketch
        assert sorted(log.checkpoints()) == [0, 1]
        assert log.influence().scores.shape == (2 * BATCH, len(TARGET_IDS))
    np.testing.assert_allclose(rates, [0.1, 0.05])
    plan_variables = [v for t in model.gradient_tracking_plan() for v in t.variables]
    assert [v.path for v in plan_variables] == [v.path for v in model.trainable_variables]
    assert list(layout.variables) == [v.path for v in plan_variables]
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    matrices = projection_matrices(layout.dim, layout.seed, shapes)
    assert any(rows.shape[0] != rows.shape[1] for rows, _ in matrices)  # not all identities
    for step, weights in enumerate(steps.weights):
        at_weights(model, weights)
        rows = slice(step * BATCH, (step + 1) * BATCH)
        found = per_example_gradients(model, x[rows], y[rows], sample_weights[rows])
        gradients = np.concatenate(found["g"], axis=1)
        expected = rates[step] * gradients @ target_gradients(model, x_targets, y_targets).T
        np.testing.assert_allclose(
            logged[rows], expected, rtol=RTOL, atol=RTOL * np.abs(expected).max()
        )
        expected_sketches = oracle_sketches(gradients, shapes, matrices)
        np.testing.assert_allclose(
            sketches[rows],
            expected_sketches,
            rtol=RTOL,
            atol=RTOL * np.abs(expected_sketches).max(),
        )


def test_the_targets_change_neither_the_update_nor_the_metrics(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x, y = data(rng, (12,), 3 * BATCH)
    targets = data(rng, (12,), 4)
    histories, weights = [], []
    for name, extra in (("plain.h5", {}), ("targets.h5", {"targets": targets, "sketch_dim": 2})):
        keras.utils.set_random_seed(3)
        model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
        logger = kgt.HDF5GradientLogger(tmp_path / name, **extra)
        history = model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[logger])
        histories.append(history.history)
        weights.append(model.get_weights())
    assert histories[1] == histories[0]
    for plain, with_targets in zip(*weights):
        np.testing.assert_array_equal(with_targets, plain)


def test_attribution_needs_no_tensorflow(tmp_path: Path) -> None:
    # As on a GPU machine without TensorFlow: any import of it fails.
    body = """
        path = sys.argv[1]
        targets = (np.ones((3, 4), "float32"), np.zeros((3, 2), "float32"))
        logger = kgt.HDF5GradientLogger(path, targets=targets, sketch_dim=2)
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4,
                  verbose=0, callbacks=[logger])
        log = kgt.GradientLog(path)
        assert log.per_example("target_influence").shape == (8, 3)
        assert log.per_example("gradient_sketch").shape == (8, 6)
        assert sorted(log.checkpoints()) == [0]
        assert log.influence().scores.shape == (8, 3)
        estimate = kgt.attribution.estimate_influence(log, model, targets)
        assert estimate.scores.shape == (8, 3)
        assert "tensorflow" not in sys.modules
        """
    run_without_tensorflow(body, tmp_path / "run.h5")


def fit_logged(model: Any, x: Any, y: Any, path: Path, **logger: Any) -> WeightsAtEachStep:
    steps = WeightsAtEachStep()
    callback = kgt.HDF5GradientLogger(path, overwrite=True, **logger)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[steps, callback])
    return steps


def test_sketched_influence_of_targets_chosen_later_matches_the_oracle(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    x, y = data(rng, (12,), 3 * BATCH)
    later_x, later_y = data(rng, (12,), 2)
    path = tmp_path / "run.h5"
    steps = fit_logged(model, x, y, path, sketch_dim=3, checkpoint_every=2)
    fresh = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))  # other names, weights
    fresh(x[:1])
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


def test_sketches_without_projection_at_every_step_give_the_exact_scores(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    model = compiled(MODELS["cnn"][0](kgt.GradientTrackingModel))
    x, y = data(rng, (8, 8, 1), 2 * BATCH)
    targets = data(rng, (8, 8, 1), 3)
    # No side of any variable exceeds 144: the sketches are the gradients themselves.
    fit_logged(model, x, y, tmp_path / "run.h5", targets=targets, sketch_dim=144,
               checkpoint_every=1)  # fmt: skip
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        exact = log.influence()
        estimate = kgt.attribution.estimate_influence(log, model, targets)
    np.testing.assert_allclose(
        estimate.scores, exact.scores, rtol=RTOL, atol=RTOL * np.abs(exact.scores).max()
    )
