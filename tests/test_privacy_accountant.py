"""`PrivacyAccountant`: epsilon in every step's logs, and in the gradient log's attributes
without the logger handed to it; the CLI summary shows it."""

from __future__ import annotations

from typing import Any

import h5py
import keras
import numpy as np
import pytest
from keras import layers
from test_privacy import compiled

import keras_gradtrack as kgt
from keras_gradtrack import cli


class BatchLogs(keras.callbacks.Callback):
    """Records each step's batch logs (after the callbacks before it in the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, Any]] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs.append(dict(logs or {}))


def private_model(sigma: float) -> Any:
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    model.make_private(l2_norm_clip=1.0, noise_multiplier=sigma)
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(40).normal(size=(16, 5)).astype("float32"), np.arange(16) % 3


def test_every_step_logs_its_epsilon_so_far() -> None:
    x, y = data()
    model = private_model(1.1)
    recorder = BatchLogs()
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5, sampling_rate=0.25)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[accountant, recorder])
    logged = [logs["epsilon"] for logs in recorder.logs]
    expected = [kgt.privacy.compute_epsilon(1.1, 0.25, n, 1e-5) for n in range(1, 9)]
    np.testing.assert_allclose(logged, expected, rtol=1e-12)
    assert logged == sorted(logged) and len(set(logged)) == 8
    np.testing.assert_allclose(history.history["epsilon"], [expected[3], expected[7]], rtol=1e-12)


def test_pld_logs_epsilon_every_n_steps_when_asked() -> None:
    x, y = data()
    model = private_model(1.1)
    recorder = BatchLogs()
    accountant = kgt.privacy.PrivacyAccountant(
        delta=1e-5, sampling_rate=0.25, accountant="pld", batch_epsilon_every=2
    )
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[accountant, recorder])
    assert ["epsilon" in logs for logs in recorder.logs] == [False, True, False, True]
    assert recorder.logs[3]["epsilon"] == kgt.privacy.compute_epsilon(1.1, 0.25, 4, 1e-5, "pld")
    quiet = BatchLogs()
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[kgt.privacy.PrivacyAccountant(delta=1e-5, accountant="pld"), quiet],
    )
    assert not any("epsilon" in logs for logs in quiet.logs)
    with pytest.raises(ValueError, match="batch_epsilon_every"):
        kgt.privacy.PrivacyAccountant(delta=1e-5, batch_epsilon_every=-1)


@pytest.mark.parametrize("logger_first", [True, False])
def test_the_log_finds_epsilon_without_the_logger_given(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], logger_first: bool
) -> None:
    """Whichever callback ends first, the file holds the privacy spent after the fit,
    and `keras-gradtrack summary` prints it."""
    x, y = data()
    model = private_model(1.1)
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, statistics=["loss"])
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5, sampling_rate=0.25)
    callbacks = [logger, accountant] if logger_first else [accountant, logger]
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
    epsilon = kgt.privacy.compute_epsilon(1.1, 0.25, 8, 1e-5)
    with h5py.File(path, "r") as file:
        assert file.attrs["dp_epsilon"] == pytest.approx(epsilon, rel=1e-12)
        assert file.attrs["dp_steps"] == 8 and file.attrs["dp_sampling_rate"] == 0.25
        assert file.attrs["dp_delta"] == 1e-5 and file.attrs["dp_accountant"] == "rdp"
    assert cli.main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"epsilon {epsilon:.4g} at delta 1e-05 after 8 steps, q=0.25" in out


def test_a_log_of_a_model_without_an_accountant_has_no_epsilon(tmp_path: Any) -> None:
    x, y = data()
    model = private_model(1.1)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss"])
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[logger])
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert "dp_epsilon" not in file.attrs and file.attrs["dp_noise_multiplier"] == 1.1


def test_epsilon_curve_is_compute_epsilon() -> None:
    curve = kgt.privacy.accounting.EpsilonCurve(0.9, 0.02, 1e-6)
    for steps in (0, 1, 7, 1000):
        assert curve.epsilon(steps) == kgt.privacy.compute_epsilon(0.9, 0.02, steps, 1e-6)
    assert kgt.privacy.accounting.EpsilonCurve(0.0, 0.02, 1e-6).epsilon(3) == np.inf
