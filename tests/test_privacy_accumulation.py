"""Logical batches: `make_private(..., accumulation_steps=k)` adds the clipped sums of
`k` physical batches, noises them once, and makes one update and one accountant step."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from keras import layers
from test_privacy import RTOL, assert_noise_std, compiled, expected_update, flat_by_column

import keras_gradtrack as kgt
from keras_gradtrack import _keras_seam


def mlp(optimizer: Any = None) -> Any:
    model = kgt.GradientTrackingSequential(
        [keras.Input((5,)), layers.Dense(7, activation="tanh"), layers.Dense(3)]
    )
    if optimizer is None:
        return compiled(model)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(80).normal(size=(16, 5)).astype("float32"), np.arange(16) % 3


def update_of(model: Any, x: Any, y: Any, batch_size: int) -> np.ndarray:
    """`-(change of the weights)` after one epoch of `fit` in order (SGD, rate 1)."""
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    return flat_by_column(model, [b - a for b, a in zip(before, after)])


def clip_and_reference(model: Any, x: Any, y: Any) -> tuple[float, np.ndarray]:
    """A bound at the median norm, and the oracle's clipped mean of the whole batch."""
    model(x[:1])
    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.median(norms))
    return clip, expected_update(model, x, y, clip)[0]


@pytest.mark.parametrize("expected_batch_size", [None, 16])
def test_k_physical_batches_make_the_update_of_their_logical_batch(
    expected_batch_size: Any,
) -> None:
    x, y = data()
    model = mlp()
    clip, expected = clip_and_reference(model, x, y)
    model.make_private(
        l2_norm_clip=clip, noise_multiplier=0.0, dataset_size=16,
        expected_batch_size=expected_batch_size, accumulation_steps=4,
    )  # fmt: skip
    update = update_of(model, x, y, batch_size=4)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())
    assert model.privacy_history == (kgt.privacy.PrivacyPhase(0.0, 1.0, 1, "shuffled"),)
    assert int(model.optimizer.iterations) == 1


def test_keras_own_gradient_accumulation_is_the_same_logical_batch() -> None:
    x, y = data()
    model = mlp(keras.optimizers.SGD(1.0, gradient_accumulation_steps=4))
    clip, expected = clip_and_reference(model, x, y)
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0, dataset_size=16)
    assert model.privacy_settings.accumulation_steps == 4
    update = update_of(model, x, y, batch_size=4)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())
    assert model.private_steps == 1


def test_the_noise_is_drawn_once_per_logical_batch() -> None:
    """Noise on each of the 4 physical batches would have twice the deviation."""
    x = np.random.default_rng(81).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 60

    def update(sigma: float) -> np.ndarray:
        keras.utils.set_random_seed(0)
        model = compiled(kgt.GradientTrackingSequential([keras.Input((40,)), layers.Dense(60)]))
        model.make_private(
            l2_norm_clip=0.7, noise_multiplier=sigma, dataset_size=16, accumulation_steps=4
        )
        return update_of(model, x, y, batch_size=4)

    assert_noise_std(update(1.3) - update(0.0), 1.3 * 0.7 / 16)


def test_an_optimizer_built_for_other_batches_is_refused() -> None:
    x, y = data()
    model = mlp()
    model.fit(x, y, batch_size=4, verbose=0)  # builds the optimizer without accumulators
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=None.*Received: accum"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, accumulation_steps=2)
    assert model.privacy_settings is None


def test_physical_batches_are_checked_against_the_logical_one() -> None:
    x, y = data()
    model = mlp()
    model.make_private(
        l2_norm_clip=1.0, noise_multiplier=1.0, dataset_size=16, expected_batch_size=16,
        accumulation_steps=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="batches of 4 examples, but fit received a batch of 8"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_the_optimizer_apply_count_is_where_the_seam_reads_it() -> None:
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    assert int(_keras_seam.optimizer_apply_count(optimizer)) == 0


def test_poisson_logical_batches_split_into_physical_ones() -> None:
    x = np.random.default_rng(82).normal(size=(64, 5)).astype("float32")
    y = np.arange(64) % 3
    batches = kgt.privacy.poisson_batches(x, y, 0.5, steps=3, seed=2, accumulation_steps=2)
    whole = kgt.privacy.poisson_batches(x, y, 0.5, steps=3, seed=2)
    sizes = [len(b[1]) for b in batches]
    assert len(sizes) == 6
    assert [a + b for a, b in zip(sizes[::2], sizes[1::2])] == [len(b[1]) for b in whole]
    model = mlp()
    model.make_private(
        l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5, dataset_size=64,
        accumulation_steps=2,
    )  # fmt: skip
    model.fit(batches, verbose=0, shuffle=False)
    assert model.privacy_history == (kgt.privacy.PrivacyPhase(1.0, 0.5, 3, "poisson"),)
