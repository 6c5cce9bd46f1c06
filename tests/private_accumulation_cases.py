"""Logical batches on a probed engine (JAX, PyTorch) (`accumulation_steps=k`, Keras' `gradient_accumulation_steps`):
k physical batches' clipped sums are added and noised once, one optimizer update and
one step of the history per logical batch."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from private_step_cases import (
    BATCH,
    assert_close,
    batch,
    clipped_sum,
    per_example_gradients,
    per_layer,
    private_model,
)


def weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]


def logical_update(model: Any, x: Any, y: Any, rate: float) -> list[np.ndarray]:
    before = weights(model)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return [(b - a) / rate for b, a in zip(before, weights(model))]


def test_two_physical_batches_make_one_update_of_their_clipped_sum() -> None:
    model = private_model("mlp")
    x, y = batch("mlp", 2 * BATCH)
    oracle = per_example_gradients(model, x, y)["g"]  # the weights do not move in between
    bound = float(np.median(np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle))))
    model.make_private(
        l2_norm_clip=bound, noise_multiplier=0.0, expected_batch_size=2 * BATCH,
        accumulation_steps=2,
    )  # fmt: skip
    found = per_layer(model, logical_update(model, x, y, 100.0))
    assert_close(found, [s / (2 * BATCH) for s in clipped_sum(oracle, bound)])
    assert model.private_steps == 1
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1


def test_the_noise_is_drawn_once_per_logical_batch() -> None:
    x, y = batch("mlp", 2 * BATCH)
    updates = []
    for sigma in (0.0, 1.5):
        model = private_model("mlp", seed=21)
        model.make_private(
            l2_norm_clip=0.5, noise_multiplier=sigma, expected_batch_size=2 * BATCH,
            accumulation_steps=2,
        )  # fmt: skip
        updates.append(np.concatenate([u.ravel() for u in logical_update(model, x, y, 100.0)]))
    noise = updates[1] - updates[0]
    want = 1.5 * 0.5 / (2 * BATCH)  # one draw over the logical batch, not two
    assert abs(np.std(noise) / want - 1.0) < 5.0 / np.sqrt(2 * noise.size)


def test_an_optimizer_compiled_with_accumulation_gives_k() -> None:
    model = private_model("mlp")
    model.compile(
        optimizer=keras.optimizers.SGD(1.0, gradient_accumulation_steps=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, dataset_size=4 * BATCH)
    assert model.privacy_settings.accumulation_steps == 2
    x, y = batch("mlp", 4 * BATCH)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert model.private_steps == 2
    assert model.privacy_history[-1].sampling_rate == 0.5
