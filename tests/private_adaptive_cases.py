"""Adaptive clipping on a probed engine (JAX, PyTorch) (Andrew et al. 2021), as on TensorFlow
(tests/test_privacy_adaptive.py, the same numbers): the bound's geometric update by hand
and toward a quantile, the bound sequence and the weights against the per-example
oracle, the count's noise, the gradient's lowered noise multiplier, the accounting, the
bound per step in fit's logs and in a gradient log, and a saved model going on from the
bound reached."""

from __future__ import annotations

import math
from typing import Any

import h5py
import keras
import numpy as np
import pytest
from private_step_cases import (
    RATE,
    assert_close,
    clipped_sum,
    per_example_gradients,
    per_layer,
    update,
)

import keras_gradtrack as kgt
from keras_gradtrack.privacy import AdaptiveClip
from keras_gradtrack.privacy.adaptive_clip import gradient_noise_multiplier, next_bound


def linear_loss(y_true: Any, y_pred: Any) -> Any:
    """`-<y_true, y_pred>` per example (`privacy_audit.linear_loss`, which imports the
    TensorFlow engine's models): its gradient at the output is `-y_true`."""
    return -keras.ops.sum(y_true * y_pred, axis=-1)


def norms_model(seed: int = 0, **private: Any) -> Any:
    """A Dense layer without bias under a loss linear in its output (target 1): example
    i's gradient is `-x_i`, whatever the weights, so its norm is `||x_i||` at every step.
    `seed` seeds Keras, from which `make_private` draws the noise's seed."""
    keras.utils.set_random_seed(seed)
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
    assert history.history["dp_l2_norm_clip"] == [pytest.approx(2.0)]
    assert history.history["dp_fraction_clipped"] == [pytest.approx(11 / 20)]


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
        model.fit(np.tile(x, (150, 1)), np.tile(y, (150, 1)), batch_size=200, verbose=0)
        target = float(np.quantile(norms, quantile))
        assert abs(bound_of(model) / target - 1) < 0.1, (quantile, bound_of(model), target)


def test_the_bounds_and_weights_are_the_oracles_step_by_step() -> None:
    """Without noise, each step clips to the bound the steps before it reached (the
    paper's update of the oracle's counts, in float64) and the update is the oracle's
    clipped sum at that bound, over B_expected."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    # SGD at rate 1: the steps stay small enough that no example's loss saturates.
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 12)).astype("float32")
    y = rng.integers(0, 3, 48)
    clip = AdaptiveClip(target_quantile=0.4, learning_rate=0.3)
    first = per_example_gradients(model, x[:16], y[:16])["g"]
    norms = np.sort(np.sqrt(sum((rows**2).sum(axis=1) for rows in first)))
    bound = float(norms[7] + norms[8]) / 2  # between two norms: no tie with a norm
    model.make_private(
        l2_norm_clip=bound, noise_multiplier=0.0, expected_batch_size=20.0, adaptive_clip=clip
    )
    logged = []
    for step in range(3):
        xb, yb = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]
        oracle = per_example_gradients(model, xb, yb)["g"]
        norms = np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle))
        found = per_layer(model, [u * RATE for u in update(model, xb, yb)])
        assert_close(found, [s / 20.0 for s in clipped_sum(oracle, bound)])
        logged.append(model.history.history["dp_l2_norm_clip"][0])
        assert logged[-1] == pytest.approx(bound, rel=1e-6)
        bound = next_bound(bound, int(np.sum(norms <= bound)), 16, 0.0, 20.0, clip)
        assert bound_of(model) == pytest.approx(bound, rel=1e-5)
    assert len(set(logged)) == 3  # the bound moved at every step
    assert model.private_steps == 3


def test_the_count_noise_moves_the_bound() -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=5.0)
    model = norms_model(
        l2_norm_clip=2.0, noise_multiplier=1.0, expected_batch_size=20, adaptive_clip=clip
    )
    model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    noiseless = next_bound(2.0, int(np.sum(norms <= 2.0)), 20, 0.0, 20, clip)
    assert bound_of(model) != pytest.approx(noiseless, rel=1e-6)


def test_the_secure_count_noise_is_not_seeded() -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=5.0)
    bounds = []
    for _ in range(2):
        model = norms_model(
            l2_norm_clip=2.0,
            noise_multiplier=1.0,
            expected_batch_size=20,
            adaptive_clip=clip,
            secure_noise=True,
        )
        model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
        bounds.append(bound_of(model))
    noiseless = next_bound(2.0, int(np.sum(norms <= 2.0)), 20, 0.0, 20, clip)
    assert bounds[0] != bounds[1] and noiseless not in bounds


def test_the_count_noise_has_deviation_clipped_count_stddev() -> None:
    """`b_t`'s noise is `N(0, sigma_b^2) / B_expected`: read back from the bounds of 60
    one-step epochs (each step's draw has a key of its own: the seed folded with the
    step) and the fraction each clipped (5 standard errors of the sample deviation: 46%)."""
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=3.0)
    model = norms_model(
        l2_norm_clip=2.0, noise_multiplier=1.0, expected_batch_size=20, adaptive_clip=clip
    )
    history = model.fit(x, y, batch_size=20, epochs=60, shuffle=False, verbose=0).history
    bounds = np.array([*history["dp_l2_norm_clip"], bound_of(model)], np.float64)
    unclipped = 20 * (1 - np.array(history["dp_fraction_clipped"], np.float64))
    # log(C_{t+1} / C_t) = -eta ((unclipped_t - B/2 + noise_t) / B_expected + 1/2 - gamma)
    fraction = -np.log(bounds[1:] / bounds[:-1]) / 0.2 + 0.5
    draws = (fraction - 0.5) * 20 - (unclipped - 10)
    assert abs(np.std(draws) / 3.0 - 1) < 5 / np.sqrt(2 * len(draws)), np.std(draws)


def test_the_gradient_noise_has_the_lowered_multiplier() -> None:
    """sigma 1 with sigma_b 0.6: the clipped sum's noise has multiplier
    (1 - 1.2^-2)^(-1/2) = 1.81, not 1 (2400 weights: 5 relative standard errors 7%)."""
    x = np.random.default_rng(8).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 60
    clip = AdaptiveClip(0.5, 0.2, clipped_count_stddev=0.6)

    def weights_after(sigma: float) -> np.ndarray:
        keras.utils.set_random_seed(0)
        model = kgt.GradientTrackingSequential([keras.Input((40,)), keras.layers.Dense(60)])
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.make_private(l2_norm_clip=0.7, noise_multiplier=sigma, adaptive_clip=clip)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    noise = weights_after(1.0) - weights_after(0.0)
    expected = gradient_noise_multiplier(1.0, 0.6) * 0.7 / 16
    assert abs(noise.std() / expected - 1) < 5 / np.sqrt(2 * noise.size), noise.std()


def test_the_privacy_spent_is_the_users_noise_multiplier() -> None:
    """The accountant is told sigma (the pair of queries composes to it), as on TensorFlow."""
    x = np.random.default_rng(9).normal(size=(40, 6)).astype("float32")
    clip = AdaptiveClip(0.5, 0.2, clipped_count_stddev=4.0)
    model = norms_model(
        l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.25, adaptive_clip=clip
    )
    model.fit(x, np.ones((40, 1), "float32"), batch_size=10, epochs=2, verbose=0)
    assert model.privacy_history == (kgt.privacy.PrivacyPhase(1.1, 0.25, 8, "poisson"),)
    assert model.epsilon(1e-5) == kgt.privacy.compute_epsilon(1.1, 0.25, 8, 1e-5)
    assert model.privacy_settings.gradient_noise_multiplier == pytest.approx(
        gradient_noise_multiplier(1.1, 4.0)
    )


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
        assert log.attrs["backend"] == keras.backend.backend()
    assert len(logged) == 4 and logged[0] == pytest.approx(2.0)
    assert logged[-1] == pytest.approx(history.history["dp_l2_norm_clip"][-1])
    bound = 2.0
    for step in range(4):
        batch = np.linalg.norm(x[10 * (step % 2) : 10 * (step % 2) + 10], axis=1)
        assert logged[step] == pytest.approx(bound, rel=1e-6)
        # Each step's fraction clipped is against its own bound.
        assert fraction[step] == pytest.approx(np.mean(batch > bound))
        bound = next_bound(bound, int(np.sum(batch <= bound)), 10, 0.0, 20, AdaptiveClip(0.5, 0.2))


def test_a_saved_model_goes_on_from_the_bound_reached(tmp_path: Any) -> None:
    norms = np.linspace(0.5, 4.0, 20)
    x, y = inputs_with_norms(norms), np.ones((20, 1), "float32")
    clip = AdaptiveClip(0.5, 0.2)
    model = norms_model(
        l2_norm_clip=2.0, noise_multiplier=0.0, expected_batch_size=20, adaptive_clip=clip
    )
    model.fit(x, y, batch_size=20, epochs=3, shuffle=False, verbose=0)
    reached = bound_of(model)
    assert reached != pytest.approx(2.0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(
        tmp_path / "m.keras", custom_objects={"linear_loss": linear_loss}
    )
    assert loaded.privacy_settings.adaptive_clip == clip
    assert bound_of(loaded) == pytest.approx(reached)
    assert loaded.private_steps == 3
    # The next step clips to the bound reached and moves it on.
    history = loaded.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    assert history.history["dp_l2_norm_clip"] == [pytest.approx(reached, rel=1e-6)]
    expected = next_bound(reached, int(np.sum(norms <= reached)), 20, 0.0, 20, clip)
    assert bound_of(loaded) == pytest.approx(expected, rel=1e-6)


def test_adaptive_clip_is_refused_with_bounds_per_layer_or_logical_batches() -> None:
    with pytest.raises(ValueError, match="Adaptive clipping moves one bound"):
        norms_model(l2_norm_clip={"dense": 1.0}, noise_multiplier=1.0, adaptive_clip=AdaptiveClip())
    with pytest.raises(ValueError, match="Adaptive clipping updates its bound"):
        norms_model(
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            adaptive_clip=AdaptiveClip(),
            accumulation_steps=2,
        )
