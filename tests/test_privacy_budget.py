"""A target epsilon: `make_private` finds the smallest noise that keeps it over the
planned steps, the history already spent counted; no step takes the model past it."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from keras import layers
from test_privacy import compiled

import keras_gradtrack as kgt

DELTA = 1e-5


def model() -> Any:
    return compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))


def data() -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(70).normal(size=(16, 5)).astype("float32"), np.arange(16) % 3


def epsilon_of(phases: list[tuple[float, float, int]]) -> float:
    return kgt.privacy.history_epsilon(
        [kgt.privacy.PrivacyPhase(sigma, q, steps) for sigma, q, steps in phases], DELTA
    )


def test_the_noise_for_a_target_is_the_smallest_with_the_history_counted(capsys: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.5, dataset_size=16)
    m.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 8 steps at q = 0.25
    m.make_private(
        l2_norm_clip=1.0, target_epsilon=20.0, delta=DELTA, epochs=3, sampling_rate=0.5,
        dataset_size=16,
    )  # fmt: skip
    sigma = m.privacy_history[-1].noise_multiplier
    assert m.privacy_settings.noise_multiplier == sigma
    assert f"noise_multiplier={sigma:.6g}" in capsys.readouterr().out
    planned = 6  # 3 epochs at q = 0.5
    assert epsilon_of([(1.5, 0.25, 8), (sigma, 0.5, planned)]) <= 20.0
    assert epsilon_of([(1.5, 0.25, 8), (0.99 * sigma, 0.5, planned)]) > 20.0
    # Without the history, less noise would do.
    assert kgt.privacy.compute_noise_multiplier(20.0, 0.5, planned, DELTA) < sigma


def test_a_target_already_spent_is_refused() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=0.3, dataset_size=16)
    m.fit(x, y, batch_size=8, epochs=2, verbose=0)
    with pytest.raises(ValueError, match=r"already spent.*reaches target_epsilon=1.0"):
        m.make_private(
            l2_norm_clip=1.0, target_epsilon=1.0, delta=DELTA, epochs=1, sampling_rate=0.5
        )


def test_training_stops_before_the_step_past_the_budget_and_refuses_the_next_fit(
    tmp_path: Any,
) -> None:
    x, y = data()
    m = model()
    m.make_private(
        l2_norm_clip=1.0, target_epsilon=8.0, delta=DELTA, epochs=2, dataset_size=16,
        expected_batch_size=4,
    )  # fmt: skip
    sigma = m.privacy_history[-1].noise_multiplier
    with pytest.warns(UserWarning, match=r"privacy budget .* is spent.*Training stops here"):
        history = m.fit(x, y, batch_size=4, epochs=6, verbose=0)
    steps = m.private_steps
    assert 8 <= steps < 24 and len(history.history["loss"]) < 6
    assert m.epsilon(DELTA) <= 8.0
    assert epsilon_of([(sigma, 0.25, steps + 1)]) > 8.0  # the step not taken
    before = [v.numpy() for v in m.trainable_variables]
    with pytest.raises(ValueError, match=r"privacy budget .* is spent"):
        m.fit(x, y, batch_size=4, verbose=0)
    assert m.private_steps == steps
    for b, a in zip(before, m.trainable_variables):
        np.testing.assert_array_equal(b, a.numpy())
    # The budget is saved with the model.
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_settings.budget == kgt.privacy.PrivacyBudget(8.0, DELTA, "rdp")
    with pytest.raises(ValueError, match=r"privacy budget .* is spent"):
        loaded.fit(x, y, batch_size=4, verbose=0)


def test_a_budget_with_a_given_noise_is_kept_too() -> None:
    x, y = data()
    m = model()
    m.make_private(
        l2_norm_clip=1.0, noise_multiplier=1.0, target_epsilon=10.0, delta=DELTA,
        sampling_rate=0.25, dataset_size=16, accountant="pld",
    )  # fmt: skip
    with pytest.warns(UserWarning, match="Training stops here"):
        m.fit(kgt.privacy.poisson_batches(x, y, 0.25, seed=0), epochs=40, verbose=0, shuffle=False)
    assert m.epsilon(DELTA, accountant="pld") <= 10.0
    assert m.privacy_history[-1].noise_multiplier == 1.0


def test_a_target_needs_its_plan() -> None:
    m = model()
    with pytest.raises(ValueError, match="needs the sampling rate"):
        m.make_private(l2_norm_clip=1.0, target_epsilon=3.0, delta=DELTA, epochs=2)
    with pytest.raises(ValueError, match="needs the sampling rate"):
        m.make_private(
            l2_norm_clip=1.0, noise_multiplier=1.0, target_epsilon=3.0, delta=DELTA,
            dataset_size=16,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs the planned training: pass `epochs="):
        m.make_private(l2_norm_clip=1.0, target_epsilon=3.0, delta=DELTA, sampling_rate=0.1)
    with pytest.raises(ValueError, match="Expected delta"):
        m.make_private(l2_norm_clip=1.0, target_epsilon=3.0, epochs=1, sampling_rate=0.1)
    with pytest.raises(ValueError, match="Expected noise_multiplier, or target_epsilon"):
        m.make_private(l2_norm_clip=1.0)
    assert m.privacy_settings is None and m.privacy_history == ()
