"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021): the bound's geometric
update toward a quantile of the per-example norms, on one step by hand and over many
steps, the gradient noise multiplier that keeps the user's sigma, and the bound per step
in fit's logs and in a gradient log."""

from __future__ import annotations

import math
from typing import Any

import h5py
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt
from keras_gradtrack.privacy import AdaptiveClip
from keras_gradtrack.privacy.adaptive_clip import gradient_noise_multiplier, next_bound
from keras_gradtrack.privacy_audit import linear_loss


def norms_model(**private: Any) -> Any:
    """A Dense layer without bias under a loss linear in its output (target 1): example
    i's gradient is `-x_i`, whatever the weights, so its norm is `||x_i||` at every step."""
    keras.utils.set_random_seed(0)
    model = kgt.GradientTrackingSequential(
        [keras.Input((6,)), keras.layers.Dense(1, use_bias=False)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=linear_loss)
    model.make_private(**private)
    return model


def inputs_with_norms(norms: np.ndarray) -> np.ndarray:
    directions = np.random.default_rng(1).normal(size=(len(norms), 6))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return (directions * norms[:, None]).astype("float32")


def bound_of(model: Any) -> float:
    return float(model.__dict__["_adaptive_clip_bound"].numpy())


def test_gradient_noise_multiplier_is_the_papers() -> None:
    """`sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`; the pair of Gaussian queries
    (noise multipliers sigma_grad and 2 sigma_b) composes back to sigma."""
    sigma, sigma_b = 1.1, 3.0
    found = gradient_noise_multiplier(sigma, sigma_b)
    assert found == pytest.approx((1.1**-2 - 6.0**-2) ** -0.5, rel=1e-12)
    assert (found**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(sigma, rel=1e-12)
    assert gradient_noise_multiplier(sigma, 0.0) == sigma  # a noiseless count: unchanged
    with pytest.raises(ValueError, match="2 \\* clipped_count_stddev > noise_multiplier"):
        gradient_noise_multiplier(1.0, 0.5)
    model = norms_model(
        l2_norm_clip=1.0, noise_multiplier=sigma, adaptive_clip=AdaptiveClip(0.5, 0.2, sigma_b)
    )
    assert model.privacy_settings.gradient_noise_multiplier == pytest.approx(found)


def test_one_step_is_the_papers_update_by_hand() -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    model = norms_model(
        l2_norm_clip=2.0,
        noise_multiplier=0.0,
        expected_batch_size=25,
        adaptive_clip=AdaptiveClip(target_quantile=0.3, learning_rate=0.2),
    )
    history = model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    unclipped = int(np.sum(norms <= 2.0))  # 9 of 20
    # C_1 = C_0 exp(-eta (b - gamma)), b = (sum_i (1[...] - 1/2)) / B_expected + 1/2.
    expected = 2.0 * math.exp(-0.2 * ((unclipped - 10) / 25 + 0.5 - 0.3))
    assert bound_of(model) == pytest.approx(expected, rel=1e-6)
    clip = AdaptiveClip(0.3, 0.2)
    assert next_bound(2.0, unclipped, 20, 0.0, 25, clip) == pytest.approx(expected)
    # With B = B_expected, the paper's b = unclipped / B_expected.
    paper = 2.0 * math.exp(-0.2 * (unclipped / 20 - 0.3))
    assert next_bound(2.0, unclipped, 20, 0.0, 20, clip) == pytest.approx(paper)
    assert history.history["dp_l2_norm_clip"] == [pytest.approx(2.0)]


def test_the_bound_reaches_the_target_quantile() -> None:
    norms = np.random.default_rng(2).lognormal(mean=1.0, sigma=0.5, size=200)
    x, y = inputs_with_norms(norms), np.ones((200, 1), "float32")
    for quantile in (0.2, 0.7):
        model = norms_model(
            l2_norm_clip=0.3,
            noise_multiplier=0.0,
            expected_batch_size=200,
            adaptive_clip=AdaptiveClip(target_quantile=quantile, learning_rate=0.2),
        )
        # 150 steps, each the same 200 examples (one epoch: one call to the callbacks).
        model.fit(np.tile(x, (150, 1)), np.tile(y, (150, 1)), batch_size=200, verbose=0)
        target = float(np.quantile(norms, quantile))
        assert abs(bound_of(model) / target - 1) < 0.1, (quantile, bound_of(model), target)


def test_the_count_noise_moves_the_bound() -> None:
    """With clipped_count_stddev > 0 the count is noised: the bound after a step differs
    from the noiseless update, and the log holds the bound of every step."""
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=5.0)
    model = norms_model(
        l2_norm_clip=2.0, noise_multiplier=1.0, expected_batch_size=20, adaptive_clip=clip
    )
    model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    noiseless = next_bound(2.0, int(np.sum(norms <= 2.0)), 20, 0.0, 20, clip)
    assert bound_of(model) != pytest.approx(noiseless, rel=1e-6)


def test_a_gradient_log_holds_the_bound_of_every_step(tmp_path: Any) -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    model = norms_model(
        l2_norm_clip=2.0,
        noise_multiplier=0.0,
        expected_batch_size=20,
        adaptive_clip=AdaptiveClip(0.5, 0.2),
    )
    path = tmp_path / "run.h5"
    history = model.fit(
        x, y, batch_size=10, epochs=2, shuffle=False, verbose=0,
        callbacks=[kgt.HDF5GradientLogger(str(path))],
    )  # fmt: skip
    with h5py.File(path, "r") as log:
        logged = log["per_step/dp_l2_norm_clip"][:]
        fraction = log["per_step/dp_fraction_clipped"][:]
        assert log.attrs["dp_adaptive_clip"]
    assert len(logged) == 4 and logged[0] == pytest.approx(2.0)
    assert logged[-1] == pytest.approx(history.history["dp_l2_norm_clip"][-1])
    # Each step's fraction clipped is against its own bound.
    order = x  # the batches, in order (no shuffle)
    for step, bound in enumerate(logged):
        batch = np.linalg.norm(order[10 * (step % 2) : 10 * (step % 2) + 10], axis=1)
        assert fraction[step] == pytest.approx(np.mean(batch > bound))


def test_adaptive_clip_is_refused_with_bounds_per_layer() -> None:
    with pytest.raises(ValueError, match="Adaptive clipping moves one bound"):
        norms_model(l2_norm_clip={"dense": 1.0}, noise_multiplier=1.0, adaptive_clip=AdaptiveClip())
    with pytest.raises(ValueError, match="Expected AdaptiveClip's target_quantile in"):
        AdaptiveClip(target_quantile=1.5)


def test_adaptive_clip_is_refused_with_logical_batches() -> None:
    """The bound moves after every optimizer step: the physical batches of one logical
    batch would be clipped to different bounds."""
    with pytest.raises(ValueError, match="Adaptive clipping updates its bound"):
        norms_model(
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            adaptive_clip=AdaptiveClip(),
            accumulation_steps=2,
        )


def test_a_saved_model_goes_on_from_the_bound_reached(tmp_path: Any) -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(0.5, 0.2, clipped_count_stddev=5.0)
    model = norms_model(l2_norm_clip=2.0, noise_multiplier=1.0, adaptive_clip=clip)
    model.fit(x, y, batch_size=20, epochs=3, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(
        tmp_path / "m.keras", custom_objects={"linear_loss": linear_loss}
    )
    assert loaded.privacy_settings.adaptive_clip == clip
    assert bound_of(loaded) == pytest.approx(bound_of(model))


def test_the_gradient_noise_has_the_lowered_multiplier() -> None:
    """sigma 1 with sigma_b 0.6: the clipped sum's noise has multiplier
    (1 - 1.2^-2)^(-1/2) = 1.81, not 1 (2400 weights: 5 relative standard errors 7%)."""
    x = np.random.default_rng(8).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 60
    clip = AdaptiveClip(0.5, 0.2, clipped_count_stddev=0.6)

    def update(sigma: float) -> np.ndarray:
        keras.utils.set_random_seed(0)
        model = kgt.GradientTrackingSequential([keras.Input((40,)), keras.layers.Dense(60)])
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.make_private(l2_norm_clip=0.7, noise_multiplier=sigma, adaptive_clip=clip)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    noise = update(1.0) - update(0.0)
    expected = gradient_noise_multiplier(1.0, 0.6) * 0.7 / 16
    assert gradient_noise_multiplier(1.0, 0.6) == pytest.approx(1.809, abs=1e-3)
    assert abs(noise.std() / expected - 1) < 5 / np.sqrt(2 * noise.size), noise.std()
