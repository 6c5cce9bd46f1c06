"""Private training with a loss scale on a probed engine (JAX, PyTorch), as on TensorFlow (tests/test_privacy.py,
`test_mixed_precision_clips_the_unscaled_gradients_in_float32`): the norms and the
clipping are the unscaled gradients', and the optimizer receives the scaled update,
which it unscales (a `LossScaleOptimizer`, or any optimizer's `loss_scale_factor`).
Each backend's test module imports these."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS
from private_step_cases import (
    RATE,
    assert_one_step_without_noise_is_the_clipped_sum,
    batch,
    clipped_sum,
    per_layer,
    update,
)

import keras_gradtrack as kgt

per_example_gradients = importlib.import_module(
    f"{keras.backend.backend()}_oracle"
).per_example_gradients

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "loss_scale_optimizer": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(RATE)),
    "loss_scale_factor": lambda: keras.optimizers.SGD(RATE, loss_scale_factor=128.0),
}


def scaled_model(optimizer: str, seed: int = 7) -> Any:
    keras.utils.set_random_seed(seed)
    model = MODELS["mlp"][0](kgt.GradientTrackingModel)
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_without_noise_the_update_is_the_clipped_sum(optimizer: str) -> None:
    model = scaled_model(optimizer)
    assert_one_step_without_noise_is_the_clipped_sum(model, *batch("mlp"))
    assert model.private_steps == 1


def test_the_noise_is_not_scaled() -> None:
    """The noise's deviation is `sigma C / B_expected` in the update, whatever the scale."""
    x, y = batch("mlp")
    updates = []
    for sigma in (0.0, 1.3):
        model = scaled_model("loss_scale_optimizer", seed=3)
        model.make_private(l2_norm_clip=0.7, noise_multiplier=sigma, expected_batch_size=4.0)
        updates.append(np.concatenate([u.ravel() for u in update(model, x, y)]))
    noise = updates[1] - updates[0]
    want = 1.3 * 0.7 / 4.0
    assert abs(np.std(noise) / want - 1.0) < 5.0 / np.sqrt(2 * noise.size)


def test_mixed_precision_clips_the_unscaled_gradients_in_float32() -> None:
    """Under mixed_float16 (a LossScaleOptimizer), the update is the float32 oracle's
    clipped mean to float16's precision (11 significant bits), as on TensorFlow."""
    x = np.random.default_rng(17).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = kgt.GradientTrackingSequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(6, activation="tanh"),
                keras.layers.Dense(3, dtype="float32"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    oracle = per_example_gradients(model, x, y)["g"]
    norms = np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle))
    bound = float(np.median(norms))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    expected = [s / 8 for s in clipped_sum(oracle, bound)]
    scale = max(np.abs(e).max() for e in expected)
    for f, e in zip(found, expected):
        np.testing.assert_allclose(f, e, rtol=5e-3, atol=5e-3 * scale)
