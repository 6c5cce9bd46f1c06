"""The opt-in statistics on JAX (`pairwise_cosine`, `input_grad_norm`) against the `jax.grad` oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS, compiled
from backend_oracle import tracked_statistics
from jax_oracle import assert_matches_oracle, input_grad_norms, oracle_statistics

import keras_gradtrack as kgt

BATCH = 6
OPT_IN = ["pairwise_cosine", "input_grad_norm", "grad_norm", "cosine"]


def expected_statistics(model: Any, x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
    expected = oracle_statistics(model, x, y, sample_weight)
    expected["input_grad_norm"] = input_grad_norms(model, x, y, sample_weight)
    return expected


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer_block"])
def test_opt_in_statistics_match_the_oracle(name: str) -> None:
    build, shape = MODELS[name]
    rng = np.random.default_rng(2)
    x = rng.normal(size=(BATCH, *shape)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    model = compiled(build(kgt.GradientTrackingModel))
    model(x[:1])
    expected = expected_statistics(model, x, y)
    stats = model.gradient_statistics(x, y, statistics=OPT_IN)
    assert stats["pairwise_cosine"].shape == (BATCH, BATCH)
    assert_matches_oracle(stats, expected)


def test_opt_in_statistics_of_a_fit_step_with_sample_weights_and_a_sum() -> None:
    build, shape = MODELS["mlp"]
    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, *shape)).astype("float32")
    y, weights = rng.integers(0, 3, BATCH), rng.uniform(0.5, 2.0, BATCH).astype("float32")
    model = build(kgt.GradientTrackingModel)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
    )
    model(x[:1])
    expected = expected_statistics(model, x, y, weights)
    stats = tracked_statistics(model, x, y, weights, names=OPT_IN)
    assert_matches_oracle(stats, expected)


def test_a_shared_layer_and_a_sequence_dense_layer() -> None:
    inputs = keras.Input((5, 4))
    shared = keras.layers.Dense(4, activation="tanh")
    hidden = keras.layers.Dense(6)(shared(shared(inputs)))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(BATCH, 5, 4)).astype("float32"), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = expected_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y, statistics=OPT_IN), expected)


def test_several_inputs_give_one_input_gradient_norm() -> None:
    first, second = keras.Input((3,)), keras.Input((2,))
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([first, second]))
    model = compiled(kgt.GradientTrackingModel([first, second], keras.layers.Dense(3)(hidden)))
    rng = np.random.default_rng(8)
    x = [
        rng.normal(size=(BATCH, 3)).astype("float32"),
        rng.normal(size=(BATCH, 2)).astype("float32"),
    ]
    y = rng.integers(0, 3, BATCH)
    expected = expected_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y, statistics=OPT_IN), expected)


def test_input_grad_norm_is_refused_for_integer_inputs() -> None:
    inputs = keras.Input((5,), dtype="int32")
    features = keras.layers.Flatten()(keras.layers.Embedding(7, 4)(inputs))
    model = compiled(kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(features)))
    ids = np.random.default_rng(0).integers(0, 7, (BATCH, 5)).astype("int32")
    with pytest.raises(ValueError, match=r"needs float inputs.*int32"):
        model.gradient_statistics(ids, np.zeros(BATCH, "int32"), statistics=["input_grad_norm"])


def test_pairwise_cosine_with_integer_inputs() -> None:
    inputs = keras.Input((5,), dtype="int32")
    features = keras.layers.Flatten()(keras.layers.Embedding(7, 4)(inputs))
    model = compiled(kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(features)))
    rng = np.random.default_rng(3)
    ids, y = rng.integers(0, 7, (BATCH, 5)).astype("int32"), rng.integers(0, 3, BATCH)
    ids[:, 1] = ids[:, 0]  # repeated ids
    model(ids[:1])
    expected = oracle_statistics(model, ids, y)
    stats = model.gradient_statistics(ids, y, statistics=["pairwise_cosine"])
    assert_matches_oracle(stats, expected)


def test_the_logger_writes_input_grad_norm(tmp_path: Path) -> None:
    build, shape = MODELS["mlp"]
    rng = np.random.default_rng(9)
    x = rng.normal(size=(BATCH, *shape)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    model = compiled(build(kgt.GradientTrackingModel))
    model(x[:1])
    expected = input_grad_norms(model, x, y)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss", "input_grad_norm"])
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[logger])
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        written = log.per_example("input_grad_norm")
    assert_matches_oracle({"input_grad_norm": written}, {"input_grad_norm": expected})
