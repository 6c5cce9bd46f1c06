"""Losses over several outputs on a probed engine (JAX, PyTorch: a loss per output, loss
weights) against the backend's own oracle; each backend's test module imports these.

`l_i` is the compiled loss on example i alone: the sum over outputs of each loss times
its weight, written out here as the oracle's loss.
"""

from __future__ import annotations

import importlib
from typing import Any

import keras
import numpy as np
import pytest
from backend_oracle import assert_trains_as_plain, tracked_statistics
from tolerance import assert_matches_oracle

import keras_gradtrack as kgt

BACKEND = keras.backend.backend()
oracle = importlib.import_module(f"{BACKEND}_oracle")
input_grad_norms, oracle_statistics = oracle.input_grad_norms, oracle.oracle_statistics
# Mixed precision's dynamic loss scale too.
OPTIMIZERS = ["sgd", "loss_scale_optimizer"]

BATCH = 6
rng = np.random.default_rng(21)
X = rng.normal(size=(2 * BATCH, 5)).astype("float32")
TARGETS = {
    "value": rng.normal(size=(2 * BATCH, 2)).astype("float32"),
    "label": rng.integers(0, 3, 2 * BATCH),
}
WEIGHTS = {"value": 0.5, "label": 2.0}


def two_outputs(model_class: type) -> Any:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", name="trunk")(inputs)
    outputs = {
        "value": keras.layers.Dense(2, name="value")(hidden),
        "label": keras.layers.Dense(3, name="label")(hidden),
    }
    return model_class(inputs, outputs)


def mse(y: Any, y_pred: Any, sample_weight: Any) -> Any:
    return keras.losses.MeanSquaredError()(y, y_pred, sample_weight=sample_weight)


def crossentropy(y: Any, y_pred: Any, sample_weight: Any) -> Any:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss(y, y_pred, sample_weight=sample_weight)


def weighted_loss(y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The compiled loss, written out: each output's loss times its weight."""
    return WEIGHTS["value"] * mse(y["value"], y_pred["value"], sample_weight) + WEIGHTS[
        "label"
    ] * crossentropy(y["label"], y_pred["label"], sample_weight)


def compiled(model: Any, optimizer: Any = "sgd", loss_weights: Any = WEIGHTS) -> Any:
    model.compile(
        optimizer=optimizer,
        loss={
            "value": keras.losses.MeanSquaredError(),
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
        loss_weights=loss_weights,
        metrics={"label": ["accuracy"]},
    )
    return model


def first(batch: int = BATCH) -> tuple[Any, Any]:
    return X[:batch], {name: value[:batch] for name, value in TARGETS.items()}


def test_a_loss_per_output_with_loss_weights_matches_the_oracle() -> None:
    model = compiled(two_outputs(kgt.GradientTrackingModel))
    x, y = first()
    model(x[:1])
    expected = oracle_statistics(model, x, y, loss=weighted_loss)
    expected.pop("pairwise_cosine")
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_sample_weights_and_the_opt_in_statistics() -> None:
    model = compiled(two_outputs(kgt.GradientTrackingModel))
    x, y = first()
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32")
    model(x[:1])
    expected = oracle_statistics(model, x, y, weights, loss=weighted_loss)
    expected["input_grad_norm"] = input_grad_norms(model, x, y, weights, loss=weighted_loss)
    names = ["loss", "grad_norm", "cosine", "pairwise_cosine", "input_grad_norm"]
    stats = model.gradient_statistics(x, y, weights, statistics=names)
    assert_matches_oracle(stats, expected)


def test_one_loss_for_every_output_of_a_list() -> None:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = [keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)]
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    x = X[:BATCH]
    y = [TARGETS["value"][:BATCH], -TARGETS["value"][:BATCH]]

    def both(y: Any, y_pred: Any, sample_weight: Any) -> Any:
        return mse(y[0], y_pred[0], sample_weight) + mse(y[1], y_pred[1], sample_weight)

    model(x[:1])
    expected = oracle_statistics(model, x, y, loss=both)
    expected.pop("pairwise_cosine")
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_one_output_with_a_loss_weight() -> None:
    inputs = keras.Input((5,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", loss_weights=3.0)
    x, y = X[:BATCH], TARGETS["value"][:BATCH]
    model(x[:1])
    expected = oracle_statistics(model, x, y, loss=lambda y, p, w: 3.0 * mse(y, p, w))
    expected.pop("pairwise_cosine")
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_tracked_step_of_several_outputs_trains_as_keras_does(optimizer: str) -> None:
    def make() -> Any:
        if optimizer == "sgd":
            return keras.optimizers.SGD(0.1)
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))

    tracked = compiled(two_outputs(kgt.GradientTrackingModel), make())
    plain = compiled(two_outputs(keras.Model), make())
    history = assert_trains_as_plain(tracked, plain, X, TARGETS, BATCH)
    assert "label_accuracy" in history


def test_one_output_in_a_dict() -> None:
    inputs = keras.Input((5,))
    model = kgt.GradientTrackingModel(inputs, {"value": keras.layers.Dense(2)(inputs)})
    model.compile(optimizer="sgd", loss="mse")
    x, y = X[:BATCH], {"value": TARGETS["value"][:BATCH]}
    model(x[:1])
    expected = oracle_statistics(model, x, y, loss=lambda y, p, w: mse(y["value"], p["value"], w))
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


class DoubledLoss(kgt.GradientTrackingModel):
    """A `compute_loss` of one's own: twice the compiled loss."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return 2.0 * super().compute_loss(*args, **kwargs)


def test_a_compute_loss_of_ones_own_matches_the_oracle() -> None:
    # Its per-example losses are the Keras losses it reduces, as it weighs them.
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = DoubledLoss(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = X[:BATCH], TARGETS["label"][:BATCH]
    model(x[:1])
    expected = oracle_statistics(model, x, y, loss=lambda y, p, w: 2.0 * crossentropy(y, p, w))
    expected.pop("pairwise_cosine")
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
