"""GradientStatisticsToLogs: the step statistics in fit's logs, as Keras' own callbacks
(CSVLogger, TensorBoard, History) and any later callback see them."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt
from keras_gradtrack.analysis import GradientLog

KEYS = [
    "gradient_diversity",
    "noise_scale",
    "batch_grad_norm",
    "mean_cosine",
    "frac_negative_cosine",
]
RTOL = 1e-6


def small_model(metrics: list[str] | None = None) -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3, name="logits")(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
    )
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, 40)


class Recorder(keras.callbacks.Callback):
    """What a callback later in the list receives."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches.append(dict(logs or {}))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epochs.append(dict(logs or {}))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two epochs of 5 steps, every other step tracked, with Keras' own loggers after."""
    keras.utils.set_random_seed(3)
    tmp = tmp_path_factory.mktemp("logs")
    recorder = Recorder()
    model = small_model(metrics=["accuracy"])
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[
            kgt.HDF5GradientLogger(tmp / "run.h5", every_n_steps=2),
            kgt.GradientStatisticsToLogs(every_n_steps=2),
            recorder,
            keras.callbacks.CSVLogger(str(tmp / "epochs.csv")),
            keras.callbacks.TensorBoard(str(tmp / "tb"), update_freq="batch"),
        ],
    )
    with GradientLog(tmp / "run.h5") as log:
        steps = {name: log.per_step(name) for name in [*KEYS, "step", "epoch"]}
    return {"tmp": tmp, "recorder": recorder, "history": history.history, "log": steps}


def epoch_means(log: dict[str, np.ndarray], key: str) -> np.ndarray:
    return np.array([log[key][log["epoch"] == epoch].mean() for epoch in (0, 1)])


def test_tracked_steps_put_the_log_s_values_in_the_batch_logs(fitted: dict[str, Any]) -> None:
    batches, log = fitted["recorder"].batches, fitted["log"]
    assert len(batches) == 10 and log["step"].tolist() == [0, 2, 4, 6, 8]
    for step, logs in enumerate(batches):
        if step % 2:  # untracked: no value at all, never the last step's
            assert not set(KEYS) & set(logs), step
            continue
        row = step // 2
        for key in KEYS:
            np.testing.assert_allclose(logs[key], log[key][row], rtol=RTOL, err_msg=key)
        assert "loss" in logs and "accuracy" in logs  # Keras' own entries untouched


def test_epoch_logs_and_history_hold_means_over_tracked_steps(fitted: dict[str, Any]) -> None:
    log = fitted["log"]
    for key in KEYS:
        expected = epoch_means(log, key)
        np.testing.assert_allclose([e[key] for e in fitted["recorder"].epochs], expected, rtol=RTOL)
        np.testing.assert_allclose(fitted["history"][key], expected, rtol=RTOL)


def test_csv_logger_writes_the_statistics(fitted: dict[str, Any]) -> None:
    with open(fitted["tmp"] / "epochs.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    for key in KEYS:
        written = [float(row[key]) for row in rows]
        np.testing.assert_allclose(written, epoch_means(fitted["log"], key), rtol=RTOL)


def test_keras_tensorboard_writes_the_statistics(fitted: dict[str, Any]) -> None:
    accumulator_module = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    accumulator = accumulator_module.EventAccumulator(
        str(fitted["tmp"] / "tb" / "train"), size_guidance={accumulator_module.TENSORS: 0}
    )
    accumulator.Reload()

    def read(tag: str) -> dict[int, float]:
        return {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}

    log = fitted["log"]
    for key in KEYS:
        np.testing.assert_allclose(
            list(read(f"epoch_{key}").values()), epoch_means(log, key), rtol=RTOL
        )
        # Keras numbers batches itself; only the tracked ones have a value.
        batch = read(f"batch_{key}")
        assert len(batch) == len(log["step"]), key
        np.testing.assert_allclose(sorted(batch.values()), sorted(log[key]), rtol=RTOL)


def test_an_epoch_without_a_tracked_step_gets_nan(tmp_path: Path) -> None:
    recorder = Recorder()
    x, y = data()
    small_model().fit(
        x[:16],
        y[:16],
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kgt.GradientStatisticsToLogs(every_n_steps=4), recorder],
    )
    # Steps 0 and 1 in epoch 0 (step 0 tracked), steps 2 and 3 in epoch 1 (none).
    assert np.isfinite(recorder.epochs[0]["gradient_diversity"])
    assert np.isnan(recorder.epochs[1]["gradient_diversity"])


def test_a_prefix_avoids_a_metric_of_the_same_name() -> None:
    class Accuracy(kgt.statistics.Statistic):
        name = "accuracy"
        per_example = False

        def compute(self, primitives: Any) -> Any:
            return primitives.batch_size

    x, y = data()
    model = small_model(metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"already hold \['accuracy'\].*prefix="):
        model.fit(
            x, y, batch_size=8, verbose=0, callbacks=[kgt.GradientStatisticsToLogs([Accuracy()])]
        )
    recorder = Recorder()
    model = small_model(metrics=["accuracy"])
    model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[kgt.GradientStatisticsToLogs([Accuracy()], prefix="grad/"), recorder],
    )
    assert recorder.batches[0]["grad/accuracy"] == 8.0
    assert 0.0 <= recorder.batches[0]["accuracy"] <= 1.0


@pytest.mark.parametrize("statistic", ["cosine", "layer_grad_norm", "bogus"])
def test_only_one_number_per_step_is_accepted(statistic: str) -> None:
    with pytest.raises(ValueError, match=r"one value per step|Unknown statistic"):
        kgt.GradientStatisticsToLogs([statistic])


def test_a_plain_keras_model_is_refused() -> None:
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="GradientTrackingModel"):
        model.fit(
            np.ones((4, 6)), np.ones((4, 3)), verbose=0, callbacks=[kgt.GradientStatisticsToLogs()]
        )
