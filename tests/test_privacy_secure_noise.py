"""`make_private(..., secure_noise=True)`: the noise drawn in float64 from the operating
system's cryptographically secure generator (`privacy/secure_noise.py` by
`engine/secure_noise.py`, after Opacus'
`secure_mode`): its distribution, its float64 resolution, that it is not seeded (two runs
with the same Keras seed differ, where the default noise repeats), and that it is the
draw the private step uses, with the noise's standard deviation `sigma C / B`."""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_privacy_noise import assert_standard_normal

import keras_gradtrack as kgt
from keras_gradtrack.engine.secure_noise import secure_standard_normal
from keras_gradtrack.privacy import secure_noise


def test_secure_draws_are_standard_normal() -> None:
    draw = tf.function(lambda: secure_standard_normal((999, 1001)))  # as in the step
    z = draw().numpy()
    assert z.shape == (999, 1001) and z.dtype == np.float32
    assert_standard_normal(z)


def test_secure_draws_are_float64_before_the_cast() -> None:
    """53-bit uniforms: the float64 draws are not float32 numbers, and reach beyond the
    float32 uniforms' largest radius `sqrt(-2 log 2^-24)` = 5.77 with their own
    probability (a sum of 4 draws over 2 has no hard bound there)."""
    z = secure_standard_normal((10**6,), dtype=tf.float64).numpy()
    assert z.dtype == np.float64
    assert np.mean(z.astype(np.float32).astype(np.float64) != z) > 0.99
    assert_standard_normal(z)


def test_secure_draws_differ_every_call() -> None:
    draw = tf.function(lambda: secure_standard_normal((1000,)))
    keras.utils.set_random_seed(0)
    first = draw().numpy()
    keras.utils.set_random_seed(0)
    assert not np.any(first == draw().numpy())


def private_model(**kwargs: Any) -> Any:
    keras.utils.set_random_seed(0)
    model = kgt.GradientTrackingSequential(
        [keras.Input((5,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.make_private(**kwargs)
    return model


def one_step_update(**kwargs: Any) -> np.ndarray:
    """The change of all weights in one private step of a freshly seeded model."""
    model = private_model(**kwargs)
    x = np.random.default_rng(1).normal(size=(16, 5)).astype("float32")
    y = np.arange(16) % 3
    before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    return after - before


def test_secure_noise_is_not_seeded_and_default_noise_is() -> None:
    default = [one_step_update(l2_norm_clip=0.5, noise_multiplier=1.0) for _ in range(2)]
    np.testing.assert_array_equal(default[0], default[1])
    secure = [
        one_step_update(l2_norm_clip=0.5, noise_multiplier=1.0, secure_noise=True) for _ in range(2)
    ]
    assert not np.any(secure[0] == secure[1])
    # Without noise the two paths agree: the difference above is the noise alone.
    clean = one_step_update(l2_norm_clip=0.5, noise_multiplier=0.0, secure_noise=True)
    # The noise's standard deviation is sigma C / B in every coordinate (467 weights).
    for noisy in secure:
        std = np.std(noisy - clean)
        assert abs(std / (1.0 * 0.5 / 16) - 1) < 0.15, std


def test_the_step_draws_from_the_operating_system() -> None:
    calls = []
    original = secure_noise.os_random_words

    def counted(count: Any) -> np.ndarray:
        calls.append(int(count))
        return original(count)

    with mock.patch.object(secure_noise, "os_random_words", counted):
        one_step_update(l2_norm_clip=0.5, noise_multiplier=1.0, secure_noise=True)
    # One call per variable, 4 words per weight (a sum of 4 draws).
    assert sorted(calls) == sorted(4 * n for n in (5 * 64, 64, 64 * 3, 3))


def test_secure_noise_is_saved_with_the_model(tmp_path: Any) -> None:
    model = private_model(l2_norm_clip=0.5, noise_multiplier=1.0, secure_noise=True)
    model.fit(np.zeros((4, 5), "float32"), np.zeros(4), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_settings.secure_noise is True


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_secure_noise_must_be_a_bool(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"Expected secure_noise to be a bool\. Received"):
        private_model(l2_norm_clip=1.0, noise_multiplier=1.0, secure_noise=bad)


def test_secure_noise_is_refused_under_xla() -> None:
    model = kgt.GradientTrackingSequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="XLA cannot compile"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, secure_noise=True)


def test_secure_noise_is_added_once_under_a_strategy(two_cpu_strategy: Any) -> None:
    """Each replica draws, only the first adds: the noise's deviation is sigma C / B, not
    sqrt(2) times it (2400 weights: 5 relative standard errors are 7%)."""
    x = np.random.default_rng(8).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 60

    def update(sigma: float) -> np.ndarray:
        with two_cpu_strategy.scope():
            model = kgt.GradientTrackingSequential([keras.Input((40,)), keras.layers.Dense(60)])
            model.compile(
                optimizer=keras.optimizers.SGD(1.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            model.make_private(l2_norm_clip=0.7, noise_multiplier=sigma, secure_noise=True)
        model.set_weights([np.zeros((40, 60), "float32"), np.zeros(60, "float32")])
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    noise = update(1.3) - update(0.0)
    assert abs(noise.std() / (1.3 * 0.7 / 16) - 1) < 5 / np.sqrt(2 * noise.size), noise.std()


def test_the_host_draw_in_pieces_is_standard_normal_and_each_piece_its_own() -> None:
    """The draw JAX and PyTorch call, on 4 threads: N(0, 1) as a whole, no piece a
    copy of another or correlated with the next."""
    count = 1_000_003
    with mock.patch.object(secure_noise.os, "cpu_count", lambda: 4):
        parts = secure_noise.pieces(count)
        z = secure_noise.host_secure_normal((count,), 1.0)
    assert len(parts) == 4 and z.shape == (count,) and z.dtype == np.float32
    assert_standard_normal(z)
    size = min(p.stop - p.start for p in parts)
    first = [z[p][:size] for p in parts]
    for a, b in itertools.pairwise(first):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(size)


@pytest.mark.parametrize("pieces", [0, 1e-9, 0.99, 1, 1.99, 2, 20.3])
@pytest.mark.parametrize("cores", [1, 2, 16])
def test_the_pieces_cover_the_draw_once(pieces: float, cores: int) -> None:
    smallest = secure_noise.NUMBERS_PER_PIECE
    count = round(pieces * smallest)
    with mock.patch.object(secure_noise.os, "cpu_count", lambda: cores):
        parts = secure_noise.pieces(count)
    assert parts[0].start == 0 and parts[-1].stop == count
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    assert len(parts) == 1 or min(p.stop - p.start for p in parts) >= smallest
    assert len(parts) == max(1, min(cores, count // smallest))


def test_the_words_read_in_pieces_are_all_read() -> None:
    """Every word of a large read comes from the generator (an unwritten piece would
    repeat a value: two equal 64-bit words by chance have probability below 1e-7)."""
    with mock.patch.object(secure_noise.os, "cpu_count", lambda: 4):
        words = secure_noise.os_random_words(600_001)
    assert words.dtype == np.uint64 and np.unique(words).size == words.size


def test_a_failed_read_in_a_piece_is_raised() -> None:
    def broken(size: int) -> bytes:
        raise OSError("no entropy")

    with (
        mock.patch.object(secure_noise.os, "cpu_count", lambda: 4),
        mock.patch.object(secure_noise.os, "urandom", broken),
        pytest.raises(OSError, match="no entropy"),
    ):
        secure_noise.host_secure_normal((300_000,), 1.0)
