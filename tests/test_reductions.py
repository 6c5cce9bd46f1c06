"""Every Keras loss reduction has an explicit per-example factor, or is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(41)
REDUCTIONS = ["sum", "sum_over_batch_size", "mean", "mean_with_sample_weight"]


def regression(loss: keras.losses.Loss, sequence: bool) -> Any:
    inputs = keras.Input((5, 4) if sequence else (4,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="sgd", loss=loss)
    return model


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("sequence", [False, True], ids=["per_example", "per_position"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_each_reduction_matches_the_oracle(reduction: str, sequence: bool, weighted: bool) -> None:
    model = regression(keras.losses.MeanSquaredError(reduction=reduction), sequence)
    shape = (10, 5) if sequence else (10,)
    x = rng.normal(size=(*shape, 4)).astype("float32")
    y = rng.normal(size=(*shape, 3)).astype("float32")
    weights = rng.uniform(0.1, 2.0, shape).astype("float32") if weighted else None
    stats = model.gradient_statistics(x, y, sample_weight=weights)
    expected = oracle_statistics(model, x, y, weights)
    assert_matches_oracle(stats, expected)
    # Losses are never shifted by a batch mean (MSE is positive).
    assert (stats["loss"] > 0).all()


def two_outputs(first: str, second: str) -> Any:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(6, activation="relu")(inputs)
    regression_out = keras.layers.Dense(2, name="value")(hidden)
    class_out = keras.layers.Dense(3, name="label")(hidden)
    model = kgt.GradientTrackingModel(inputs, {"value": regression_out, "label": class_out})
    model.compile(
        optimizer="sgd",
        loss={
            "value": keras.losses.MeanSquaredError(reduction=first),
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=second),
        },
        loss_weights={"value": 0.3, "label": 2.0},
    )
    return model


def two_output_data() -> tuple[Any, Any]:
    x = rng.normal(size=(9, 4)).astype("float32")
    y = {"value": rng.normal(size=(9, 2)).astype("float32"), "label": rng.integers(0, 3, 9)}
    return x, y


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("sum_over_batch_size", "mean"),
        ("mean_with_sample_weight", "sum_over_batch_size"),
        ("sum", "sum"),
    ],
)
def test_outputs_with_reductions_of_one_factor_match_the_oracle(first: str, second: str) -> None:
    model = two_outputs(first, second)
    x, y = two_output_data()
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


def test_outputs_with_different_factors_are_refused_before_training(tmp_path: Path) -> None:
    model = two_outputs("sum", "sum_over_batch_size")
    x, y = two_output_data()
    before = [w.copy() for w in model.get_weights()]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match=r"Received: reductions=\['sum', 'sum_over_batch_size'\]"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("reduction", [None, "none"])
def test_unreduced_losses_are_refused(tmp_path: Path, reduction: Any) -> None:
    model = regression(keras.losses.MeanSquaredError(reduction=reduction), sequence=False)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    with pytest.raises(ValueError, match=f"Received: reduction={reduction!r}"):
        model.gradient_statistics(x, y)
