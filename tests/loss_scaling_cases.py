"""Loss scaling on a probed engine (JAX, PyTorch): the statistics are the unscaled loss's,
the training is Keras' own; each backend's test module imports these.

A `LossScaleOptimizer` (or any optimizer's `loss_scale_factor`) scales the loss, so
every gradient of the step's one backward pass; the statistics divide it out, and the
optimizer receives the gradients plain Keras gives it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS
from backend_oracle import assert_trains_as_plain, tracked_statistics
from tolerance import assert_matches_oracle

import keras_gradtrack as kgt

oracle_statistics = importlib.import_module(f"{keras.backend.backend()}_oracle").oracle_statistics

BATCH = 8
rng = np.random.default_rng(11)
X = rng.normal(size=(2 * BATCH, 12)).astype("float32")
Y = rng.integers(0, 3, 2 * BATCH)

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01)
    ),
    "loss_scale_factor": lambda: keras.optimizers.Adam(0.01, loss_scale_factor=128.0),
}


def compiled_with(model: Any, optimizer: Any) -> Any:
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.fixture
def mixed_float16() -> Iterator[None]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_statistics_are_those_of_the_unscaled_loss(optimizer: str) -> None:
    model = compiled_with(MODELS["mlp"][0](kgt.GradientTrackingModel), OPTIMIZERS[optimizer]())
    model(X[:1])
    expected = oracle_statistics(model, X[:BATCH], Y[:BATCH])
    expected.pop("pairwise_cosine")
    assert_matches_oracle(tracked_statistics(model, X[:BATCH], Y[:BATCH]), expected)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_tracked_step_with_loss_scaling_trains_as_keras_does(optimizer: str) -> None:
    build = MODELS["mlp"][0]
    tracked = compiled_with(build(kgt.GradientTrackingModel), OPTIMIZERS[optimizer]())
    plain = compiled_with(build(keras.Model), OPTIMIZERS[optimizer]())
    assert_trains_as_plain(tracked, plain, X, Y, BATCH)


@pytest.mark.parametrize("name", ["cnn", "transformer_block"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_summed_batch_gradient_is_scaled_as_keras_does(optimizer: str, name: str) -> None:
    # On JAX the batch gradient of a convolution, and of Dense and EinsumDense on
    # sequences, is the sum of their per-example gradients, which the step multiplies
    # by the loss scale for the optimizer (`ProbedRule.sums_batch_gradient`).
    # SGD: Adam's update would not show a gradient off by the scale.
    sgd = {
        "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9)
        ),
        "loss_scale_factor": lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0),
    }[optimizer]
    build, shape = MODELS[name]
    x = rng.normal(size=(2 * BATCH, *shape)).astype("float32")
    tracked = compiled_with(build(kgt.GradientTrackingModel), sgd())
    plain = compiled_with(build(keras.Model), sgd())
    assert_trains_as_plain(tracked, plain, x, Y, BATCH)


def test_gradient_statistics_with_a_loss_scale_optimizer() -> None:
    model = compiled_with(
        MODELS["mlp"][0](kgt.GradientTrackingModel), OPTIMIZERS["loss_scale_optimizer"]()
    )
    model(X[:1])
    expected = oracle_statistics(model, X[:BATCH], Y[:BATCH])
    stats = model.gradient_statistics(
        X[:BATCH], Y[:BATCH], statistics=["loss", "grad_norm", "cosine", "pairwise_cosine"]
    )
    assert_matches_oracle(stats, expected)


def build_mixed(model_class: type) -> Any:
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    outputs = keras.layers.Dense(3, dtype="float32")(hidden)
    return compiled_with(model_class(inputs, outputs), "adam")


@pytest.mark.usefixtures("mixed_float16")
def test_mixed_float16_statistics_are_close_to_the_float32_oracle() -> None:
    keras.mixed_precision.set_global_policy("float32")
    reference = build_mixed(kgt.GradientTrackingModel)
    reference(X[:1])
    expected = oracle_statistics(reference, X[:BATCH], Y[:BATCH])
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = build_mixed(kgt.GradientTrackingModel)
    model(X[:1])
    model.set_weights(reference.get_weights())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    stats = tracked_statistics(model, X[:BATCH], Y[:BATCH])
    # float16 keeps 11 significant bits: the tolerances of tests/test_mixed_precision.py.
    for name in ("loss", "grad_norm", "layer_grad_norm", "batch_grad_norm"):
        np.testing.assert_allclose(stats[name], expected[name], rtol=5e-3, err_msg=name)
    for name in ("cosine", "layer_cosine"):
        np.testing.assert_allclose(stats[name], expected[name], atol=1e-2, err_msg=name)


@pytest.mark.usefixtures("mixed_float16")
def test_mixed_float16_trains_as_keras_does() -> None:
    tracked, plain = build_mixed(kgt.GradientTrackingModel), build_mixed(keras.Model)
    assert_trains_as_plain(tracked, plain, X, Y, BATCH)
