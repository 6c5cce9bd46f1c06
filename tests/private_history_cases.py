"""Private training on a probed engine (JAX, PyTorch) keeps its history as on TensorFlow: epsilon composes every
phase, the history is saved with the model and in the log, `fit`'s batches are checked
against the sampling rate, and a budget stops training before it is exceeded."""

from __future__ import annotations

import json
import warnings
from typing import Any

import dp_accounting
import h5py
import keras
import numpy as np
import pytest
from without_tensorflow import run_without_tensorflow

import keras_gradtrack as kgt

DELTA = 1e-5


def phase(sigma: float, q: float, steps: int, sampling: str) -> Any:
    return kgt.privacy.PrivacyPhase(sigma, q, steps, sampling)


def model() -> Any:
    found = kgt.GradientTrackingSequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)]
    )
    found.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return found


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


def test_epsilon_composes_two_phases_and_survives_save_and_load(tmp_path: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, dataset_size=16)
    m.fit(x, y, batch_size=4, epochs=2, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.5)
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert m.privacy_history == (phase(1.1, 0.25, 8, "shuffled"), phase(2.0, 0.5, 2, "poisson"))
    assert m.private_steps == 10
    for pld in (False, True):
        expected = dp_accounting_epsilon([(1.1, 0.25, 8), (2.0, 0.5, 2)], DELTA, pld)
        assert m.epsilon(DELTA, "pld" if pld else "rdp") == pytest.approx(expected, rel=1e-12)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_history == m.privacy_history
    assert loaded.epsilon(DELTA) == m.epsilon(DELTA)
    assert loaded.privacy_settings.noise_multiplier == 2.0
    for got, want in zip(weights(loaded), weights(m)):
        np.testing.assert_array_equal(got, want)
    loaded.fit(x, y, batch_size=8, verbose=0)  # the loaded model trains on, privately
    assert loaded.privacy_history[-1] == phase(2.0, 0.5, 4, "poisson")


def test_the_log_holds_the_norms_the_fraction_clipped_and_the_history(tmp_path: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=0.1, noise_multiplier=0.5, dataset_size=16)
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, statistics=["grad_norm"])
    accountant = kgt.privacy.PrivacyAccountant(delta=DELTA)
    history = m.fit(x, y, batch_size=8, verbose=0, callbacks=[logger, accountant])
    assert accountant.epsilon == pytest.approx(m.epsilon(DELTA), rel=1e-12)
    log = kgt.GradientLog(path)
    norms = log.per_example("dp_grad_norm")
    np.testing.assert_allclose(norms, log.per_example("grad_norm"), rtol=1e-6)
    clipped = (norms.reshape(2, 8) > 0.1).mean(axis=1)
    np.testing.assert_allclose(log.per_step("dp_fraction_clipped"), clipped)
    np.testing.assert_allclose(history.history["dp_fraction_clipped"], [clipped[-1]])
    with h5py.File(path, "r") as file:
        assert file.attrs["dp_noise_multiplier"] == 0.5
        assert file.attrs["dp_l2_norm_clip"] == 0.1
        assert file.attrs["dp_epsilon"] == pytest.approx(m.epsilon(DELTA), rel=1e-12)
        assert json.loads(file.attrs["dp_privacy_history"]) == [
            {"noise_multiplier": 0.5, "sampling_rate": 0.5, "steps": 2, "sampling": "shuffled"}
        ]


def test_fit_refuses_batches_other_than_the_sampling_says() -> None:
    x, y = data()
    m = model()
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.25, dataset_size=16)
    before = weights(m)
    with pytest.raises(ValueError, match=r"Poisson.*received a batch of 16"):
        m.fit(x, y, batch_size=16, verbose=0)
    m.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=4, dataset_size=16)
    with pytest.raises(ValueError, match="batches of 4 examples, but fit received a batch of 8"):
        m.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"dataset_size=16, but fit received 12"):
        m.fit(x[:12], y[:12], batch_size=4, verbose=0)
    for got, want in zip(weights(m), before):
        np.testing.assert_array_equal(got, want)
    assert m.private_steps == 0


def test_a_target_epsilon_stops_training_within_the_budget(tmp_path: Any) -> None:
    x, y = data()
    m = model()
    m.make_private(
        l2_norm_clip=1.0, target_epsilon=8.0, delta=DELTA, epochs=2, dataset_size=16,
        expected_batch_size=4,
    )  # fmt: skip
    sigma = m.privacy_history[-1].noise_multiplier
    # Sigma found by bisection keeps the 8 planned steps within the budget.
    assert dp_accounting_epsilon([(sigma, 0.25, 8)], DELTA, pld=False) <= 8.0
    spent = r"privacy budget .* is spent.*Training stops here"
    with pytest.warns(UserWarning, match=spent), warnings.catch_warnings():
        # Keras' own `convert_to_numpy` of a torch tensor (numpy 2's `copy`).
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="keras")
        history = m.fit(x, y, batch_size=4, epochs=6, verbose=0)
    steps = m.private_steps
    assert 8 <= steps < 24 and len(history.history["loss"]) < 6
    assert m.epsilon(DELTA) <= 8.0
    assert dp_accounting_epsilon([(sigma, 0.25, steps + 1)], DELTA, pld=False) > 8.0
    before = weights(m)
    with pytest.raises(ValueError, match=r"privacy budget .* is spent"):
        m.fit(x, y, batch_size=4, verbose=0)
    assert m.private_steps == steps
    for got, want in zip(weights(m), before):
        np.testing.assert_array_equal(got, want)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_settings.budget == kgt.privacy.PrivacyBudget(8.0, DELTA, "rdp")
    with pytest.raises(ValueError, match=r"privacy budget .* is spent"):
        loaded.fit(x, y, batch_size=4, verbose=0)


def test_private_training_and_its_log_need_no_tensorflow(tmp_path: Any) -> None:
    # As on a GPU machine without TensorFlow: any import of it fails.
    body = """
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, dataset_size=8)
        model.fit(
            np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0,
            callbacks=[kgt.HDF5GradientLogger(sys.argv[1])],
        )
        assert model.private_steps == 2
        assert model.epsilon(1e-5) > 0
        assert kgt.GradientLog(sys.argv[1]).per_example("dp_grad_norm").shape == (8,)
        # Poisson batches: a keras.utils.PyDataset here, without TensorFlow's tf.data.
        x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
        batches = kgt.privacy.poisson_batches(x, np.ones((40, 2), "float32"), 0.25, steps=3)
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=10)
        model.fit(batches, epochs=2, verbose=0, shuffle=False)
        assert model.private_steps == 8
        assert "tensorflow" not in sys.modules
        """
    run_without_tensorflow(body, tmp_path / "run.h5")
