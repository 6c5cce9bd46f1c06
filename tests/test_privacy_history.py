"""The privacy history: each `make_private` starts a phase and keeps the ones before;
epsilon composes them all; the history travels with the model, the log and checkpoints;
`fit` checks its batches against the sampling rate before any step."""

from __future__ import annotations

import json
from typing import Any

import dp_accounting
import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from test_privacy import compiled

import keras_gradtrack as kgt
from keras_gradtrack.io import checkpoints as checkpoint_files


def phase(sigma: float, q: float, steps: int, sampling: str) -> Any:
    return kgt.privacy.PrivacyPhase(sigma, q, steps, sampling)


def model() -> Any:
    return compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))


def data(n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(60).normal(size=(n, 5)).astype("float32"), np.arange(n) % 3


def weights(m: Any) -> list[np.ndarray]:
    return [v.numpy() for v in m.trainable_variables]


def dp_accounting_epsilon(phases: list[tuple[float, float, int]], delta: float, pld: bool) -> float:
    """dp-accounting's own composition of `(sigma, q, steps)` phases."""
    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        for sigma, q, steps in phases
    ]
    found = dp_accounting.pld.PLDAccountant() if pld else dp_accounting.rdp.RdpAccountant()
    found.compose(dp_accounting.ComposedDpEvent(events))
    return float(found.get_epsilon(delta))


def test_a_second_make_private_keeps_the_first_phase() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    m.fit(x, y, batch_size=4, epochs=2, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.5, dataset_size=16)
    m.fit(
        kgt.privacy.poisson_batches(x, y, sampling_rate=0.5, steps=3, seed=0),
        shuffle=False,
        verbose=0,
    )
    assert m.privacy_history == (
        phase(1.1, 0.25, 8, "shuffled"),
        phase(2.0, 0.5, 3, "poisson"),
    )
    assert m.private_steps == 11
    for pld in (False, True):
        expected = dp_accounting_epsilon([(1.1, 0.25, 8), (2.0, 0.5, 3)], 1e-5, pld)
        found = m.epsilon(1e-5, accountant="pld" if pld else "rdp")
        assert found == pytest.approx(expected, rel=1e-12)
    # A phase without steps is replaced by the next one.
    m.make_private(l2_norm_clip=1.0, noise_multiplier=3.0, sampling_rate=0.5)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=4.0, sampling_rate=0.5)
    assert [p.noise_multiplier for p in m.privacy_history] == [1.1, 2.0, 4.0]


def test_the_accountant_composes_every_phase() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    m.fit(x, y, batch_size=4, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=0.8, dataset_size=16)
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5)
    m.fit(x, y, batch_size=8, verbose=0, callbacks=[accountant])
    expected = dp_accounting_epsilon([(1.1, 0.25, 4), (0.8, 0.5, 2)], 1e-5, pld=False)
    assert accountant.epsilon == pytest.approx(expected, rel=1e-9)


def test_an_accountant_rate_other_than_the_history_is_refused() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.25, dataset_size=16)
    before = weights(m)
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5, sampling_rate=0.5)
    with pytest.raises(ValueError, match=r"sampling_rate=0.5.*sampling_rate=0.25"):
        m.fit(x, y, batch_size=4, verbose=0, callbacks=[accountant])
    for b, a in zip(before, weights(m)):
        np.testing.assert_array_equal(b, a)


def test_the_history_survives_save_and_load_and_continues(tmp_path: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    m.fit(x, y, batch_size=4, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=2.0, dataset_size=16)
    m.fit(x, y, batch_size=8, verbose=0)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_history == m.privacy_history
    loaded.fit(x, y, batch_size=8, verbose=0)
    assert loaded.privacy_history == (
        phase(1.1, 0.25, 4, "shuffled"),
        phase(2.0, 0.5, 4, "shuffled"),
    )


def test_the_log_and_its_checkpoints_hold_the_history(tmp_path: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    m.fit(x, y, batch_size=4, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=2.0, dataset_size=16)
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, statistics=["loss"], checkpoint_every=1)
    m.fit(x, y, batch_size=8, verbose=0, callbacks=[logger])
    expected = [
        {"noise_multiplier": 1.1, "sampling_rate": 0.25, "steps": 4, "sampling": "shuffled"},
        {"noise_multiplier": 2.0, "sampling_rate": 0.5, "steps": 2, "sampling": "shuffled"},
    ]
    with h5py.File(path, "r") as file:
        assert json.loads(file.attrs["dp_privacy_history"]) == expected
    found = checkpoint_files.checkpoints(path)
    assert len(found) == 2
    # Each checkpoint: the weights before its step, the history before that step.
    second = checkpoint_files.privacy_history_of(found[max(found)])
    assert [p["steps"] for p in second] == [4, 1]


def test_fit_refuses_a_batch_size_other_than_the_sampling_rate_says() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.25, dataset_size=16)
    before = weights(m)
    with pytest.raises(ValueError, match=r"Poisson.*received a batch of 16"):
        m.fit(x, y, batch_size=16, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=4, dataset_size=16)
    with pytest.raises(ValueError, match="batches of 4 examples, but fit received a batch of 8"):
        m.fit(x, y, batch_size=8, verbose=0)
    for b, a in zip(before, weights(m)):
        np.testing.assert_array_equal(b, a)
    assert m.private_steps == 0


def test_fit_refuses_a_dataset_of_another_size() -> None:
    x, y = data(24)
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    with pytest.raises(ValueError, match="dataset_size=16, but fit received 24"):
        m.fit(x, y, batch_size=4, verbose=0)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(ValueError, match="dataset_size=16, but fit received 6 batches of 4"):
        m.fit(batches, shuffle=False, verbose=0)
    assert m.private_steps == 0


def test_poisson_batches_pass_the_check() -> None:
    x, y = data(200)
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.1, dataset_size=200)
    m.fit(kgt.privacy.poisson_batches(x, y, sampling_rate=0.1, seed=1), shuffle=False, verbose=0)
    assert m.privacy_history == (phase(1.1, 0.1, 10, "poisson"),)
