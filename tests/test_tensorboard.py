"""TensorBoard event files (TensorBoardGradientLogger during fit, write_tensorboard and
`keras-gradtrack tensorboard` afterwards), read back with TensorBoard's own reader and
compared with the HDF5 log."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from test_analysis import LAYERS, write_log

import keras_gradtrack as kgt
from keras_gradtrack import cli
from keras_gradtrack.analysis import GradientLog

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
tensor_util = pytest.importorskip("tensorboard.util.tensor_util")

RTOL = 1e-6
BUCKETS = 30


def read_events(logdir: Path | str) -> dict[str, dict[int, np.ndarray]]:
    """tag -> step -> value (a scalar, or a histogram's (buckets, 3) array), by
    TensorBoard's own reader; a tag's kind is `kinds[tag]`."""
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    events: dict[str, dict[int, np.ndarray]] = {}
    for tag in accumulator.Tags()["tensors"]:
        plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
        events[f"{plugin}:{tag}"] = {
            event.step: tensor_util.make_ndarray(event.tensor_proto)
            for event in accumulator.Tensors(tag)
        }
    return events


def expected_buckets(values: np.ndarray, buckets: int = BUCKETS) -> np.ndarray:
    """Counts per bucket as TensorBoard defines them: equal widths from min to max."""
    low, high = values.min(), values.max()
    if high == low:
        return np.array([len(values)])
    index = np.floor((values - low) / ((high - low) / buckets)).astype(int)
    return np.bincount(np.minimum(index, buckets - 1), minlength=buckets)


def assert_events_match_the_log(
    events: dict[str, dict[int, np.ndarray]], path: Path, histogram_every: int
) -> None:
    """Every scalar and histogram against the log's rows of the same step."""
    with GradientLog(path) as log:
        steps = log.per_step("step")
        assert len(steps) > 2
        for name in log.per_step_names:
            values = log.per_step(name)
            columns = {name: values} if values.ndim == 1 else {}
            for k, layer in enumerate(log.layers if values.ndim == 2 else ()):
                columns[f"{name}/{layer}"] = values[:, k]
            for tag, column in columns.items():
                written = events[f"scalars:{tag}"]
                assert sorted(written) == steps.tolist(), tag
                np.testing.assert_allclose([written[s] for s in steps], column, rtol=RTOL)
        example_steps = log.per_example("step")
        histogram_steps = steps[::histogram_every].tolist()
        checked = 0
        for name in log.per_example_names:
            values = log.per_example(name)
            columns = {name: values} if values.ndim == 1 else {}
            for k, layer in enumerate(log.layers if values.ndim == 2 else ()):
                columns[f"{name}/{layer}"] = values[:, k]
            for tag, column in columns.items():
                means = events[
                    f"scalars:{tag.replace('/', '_mean/') if '/' in tag else tag + '_mean'}"
                ]
                histograms = events[f"histograms:{tag}"]
                assert sorted(histograms) == histogram_steps, tag
                for step in steps.tolist():
                    rows = column[example_steps == step].astype(np.float64)
                    finite = rows[np.isfinite(rows)]
                    np.testing.assert_allclose(means[step], finite.mean(), rtol=RTOL)
                    if step not in histograms:
                        continue
                    buckets = histograms[step]
                    counts = buckets[:, 2]
                    assert counts.sum() == len(finite), (tag, step)
                    np.testing.assert_allclose(buckets[0, 0], finite.min(), rtol=RTOL)
                    np.testing.assert_allclose(buckets[-1, 1], finite.max(), rtol=RTOL)
                    # The sum of the histogram's values: its count times the mean scalar.
                    np.testing.assert_allclose(
                        counts.sum() * means[step], finite.sum(), rtol=RTOL, atol=1e-6
                    )
                    np.testing.assert_array_equal(counts, expected_buckets(finite))
                    checked += 1
        assert checked > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fit logged to HDF5 and, at the same time, to TensorBoard."""
    keras.utils.set_random_seed(7)
    tmp = tmp_path_factory.mktemp("tensorboard")
    inputs = keras.Input((6,), name="pixels")
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="logits")(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, 40)
    path, logdir = tmp / "run.h5", tmp / "tb_fit"
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[
            kgt.HDF5GradientLogger(path, every_n_steps=2),
            kgt.TensorBoardGradientLogger(logdir, every_n_steps=2, histogram_every=2),
        ],
    )
    return path, logdir


def test_the_callback_writes_the_log_s_numbers(trained: tuple[Path, Path]) -> None:
    path, logdir = trained
    events = read_events(logdir)
    assert_events_match_the_log(events, path, histogram_every=2)
    # Steps 0, 2, ..., 8 tracked of 10: TensorBoard's steps are the log's.
    assert sorted(events["scalars:gradient_diversity"]) == [0, 2, 4, 6, 8]
    assert {f"histograms:layer_grad_norm/{layer}" for layer in ("hidden", "logits")} <= set(events)


def test_write_tensorboard_from_a_fit_s_log_equals_the_callback(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    path, logdir = trained
    converted = read_events(kgt.write_tensorboard(path, tmp_path / "tb", histogram_every=2))
    during_fit = read_events(logdir)
    assert converted.keys() == during_fit.keys()
    for tag, steps in during_fit.items():
        assert converted[tag].keys() == steps.keys(), tag
        for step, value in steps.items():
            np.testing.assert_allclose(converted[tag][step], value, rtol=RTOL, err_msg=tag)


@pytest.mark.parametrize("histogram_every", [1, 3])
def test_write_tensorboard_matches_a_log_with_nan_cosines(
    tmp_path: Path, histogram_every: int
) -> None:
    written = write_log(tmp_path / "run.h5")
    with GradientLog(written.path) as log:
        assert np.isnan(log.per_example("cosine")).any()  # left out of means and histograms
    logdir = kgt.write_tensorboard(written.path, tmp_path / "tb", histogram_every=histogram_every)
    events = read_events(logdir)
    assert_events_match_the_log(events, written.path, histogram_every)
    assert {f"histograms:layer_grad_norm/{layer}" for layer in LAYERS} <= set(events)
    assert "scalars:learning_rate" in events


def test_the_command_writes_the_event_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = write_log(tmp_path / "run.h5")
    status = cli.main(["tensorboard", str(written.path), "--logdir", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    assert status == 0 and f"tensorboard --logdir {tmp_path / 'tb'}" in out
    assert_events_match_the_log(read_events(tmp_path / "tb"), written.path, histogram_every=1)
    # Without --logdir: beside the log.
    assert cli.main(["tensorboard", str(written.path), "--histogram-every", "2"]) == 0
    assert read_events(tmp_path / "run_tensorboard")


def test_a_missing_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="No keras_gradtrack log at"):
        kgt.write_tensorboard(tmp_path / "missing.h5", tmp_path / "tb")
    status = cli.main(["tensorboard", str(tmp_path / "missing.h5")])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("keras-gradtrack: error: No keras_gradtrack log at")
    assert not (tmp_path / "tb").exists() and not (tmp_path / "missing_tensorboard").exists()


def test_a_logdir_that_cannot_be_written_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = write_log(tmp_path / "run.h5")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match=f"where '{blocker}' is a file"):
        kgt.write_tensorboard(written.path, blocker / "tb")
    status = cli.main(["tensorboard", str(written.path), "--logdir", str(blocker)])
    assert status == 1 and "Expected a directory" in capsys.readouterr().err


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="permissions do not stop root"
)
def test_a_read_only_logdir_is_a_clear_error(tmp_path: Path) -> None:
    written = write_log(tmp_path / "run.h5")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="Cannot write event files"):
        kgt.write_tensorboard(written.path, read_only)


def test_the_callback_checks_its_logdir_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    inputs = keras.Input((3,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(NotADirectoryError, match="Expected a directory"):
        model.fit(
            np.ones((4, 3)),
            np.ones((4, 2)),
            verbose=0,
            callbacks=[kgt.TensorBoardGradientLogger(blocker)],
        )
    for weight, old in zip(model.get_weights(), before):
        np.testing.assert_array_equal(weight, old)


def test_without_tensorboard_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    hint = r'pip install "keras-gradtrack\[tensorboard\]"'
    with pytest.raises(ImportError, match=hint):
        kgt.TensorBoardGradientLogger(tmp_path / "tb")
    with pytest.raises(ImportError, match=hint):
        kgt.write_tensorboard(write_log(tmp_path / "run.h5").path, tmp_path / "tb")


@pytest.mark.parametrize("kwargs", [{"histogram_every": 0}, {"every_n_steps": -1}, {"buckets": 0}])
def test_the_callback_refuses_non_positive_counts(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="positive int"):
        kgt.TensorBoardGradientLogger(tmp_path / "tb", **kwargs)


def test_the_callback_needs_a_tracking_model(tmp_path: Path) -> None:
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="GradientTrackingModel"):
        model.fit(
            np.ones((4, 3)),
            np.ones((4, 2)),
            verbose=0,
            callbacks=[kgt.TensorBoardGradientLogger(tmp_path / "tb")],
        )
