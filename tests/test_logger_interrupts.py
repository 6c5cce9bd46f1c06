"""A fit stopped by an exception: its rows reach the file, and the log continues in order."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest

import keras_gradtrack as kgt

X = np.random.default_rng(9).normal(size=(64, 6)).astype("float32")
Y = np.random.default_rng(10).integers(0, 3, 64)


def small_model() -> Any:
    inputs = keras.Input((6,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


class RaiseAfter(keras.callbacks.Callback):
    """Raises `error` at the end of the `steps`-th batch of a fit (after the logger's end)."""

    def __init__(self, steps: int, error: type[BaseException] = KeyboardInterrupt):
        super().__init__()
        self.steps, self.error, self.seen = steps, error, 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen += 1
        if self.seen == self.steps:
            raise self.error("stopped")


def buffering_logger(path: Path, **kwargs: Any) -> kgt.HDF5GradientLogger:
    """A logger that writes no block before it is closed."""
    return kgt.HDF5GradientLogger(path, flush_every=1000, flush_seconds=None, **kwargs)


def fit(model: Any, *callbacks: Any, epochs: int = 5) -> None:
    model.fit(X, Y, batch_size=8, epochs=epochs, verbose=0, callbacks=list(callbacks))


def assert_steps(path: Path, num_steps: int) -> None:
    """Every step once, in order, each with its 8 example rows."""
    with kgt.GradientLog(path) as log:
        assert log.per_step("step").tolist() == list(range(num_steps))
        np.testing.assert_array_equal(log.per_example("step"), np.repeat(np.arange(num_steps), 8))


def test_the_same_logger_continues_its_file_after_an_interrupt(tmp_path: Path) -> None:
    model, logger = small_model(), buffering_logger(tmp_path / "run.h5")
    with pytest.raises(KeyboardInterrupt):
        fit(model, logger, RaiseAfter(26))
    assert_steps(tmp_path / "run.h5", 26)  # written when the fit ended, no close() needed
    fit(model, logger, epochs=2)  # the notebook habit: run the cell again
    assert_steps(tmp_path / "run.h5", 26 + 16)


def test_a_new_logger_appending_after_an_interrupt_continues_the_steps(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model = small_model()
    with pytest.raises(KeyboardInterrupt):
        fit(model, buffering_logger(path), RaiseAfter(26))
    fit(model, buffering_logger(path, append=True), epochs=1)
    assert_steps(path, 26 + 8)


def test_two_loggers_on_one_file_are_refused_before_training(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model = small_model()
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(OSError, match="already open for writing in this process") as raised:
        fit(model, buffering_logger(path), buffering_logger(path, append=True))
    assert raised.value.errno == errno.EBUSY
    for old, new in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    fit(model, buffering_logger(path, append=True), epochs=1)  # the first one closed
    assert_steps(path, 8)


@pytest.mark.parametrize("name", ["learning_rate", "step", "example_id", "batch_size", "epoch"])
def test_a_user_statistic_may_not_take_a_column_name_of_the_log(name: str) -> None:
    class Shadow(kgt.statistics.Statistic):
        per_example = False

        def compute(self, primitives: Any) -> Any:
            return primitives.batch_size

    Shadow.name = name
    with pytest.raises(
        ValueError, match=rf"other than the log's own columns.*Received: .*'{name}'"
    ):
        kgt.HDF5GradientLogger("unused.h5", statistics=["loss", Shadow()])


@pytest.mark.slow
def test_rows_reach_the_file_when_fit_ends_by_an_exception_and_the_script_exits(
    tmp_path: Path,
) -> None:
    """No close(), no on_train_end: an interrupt caught by the script, then an error
    in another callback that ends the script."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_logger_interrupts import RaiseAfter, buffering_logger, fit, small_model
        from pathlib import Path

        model = small_model()
        try:
            fit(model, buffering_logger(Path({str(tmp_path / "interrupted.h5")!r})), RaiseAfter(21))
        except KeyboardInterrupt:
            pass
        fit(model, buffering_logger(Path({str(tmp_path / "failed.h5")!r})), RaiseAfter(13, RuntimeError))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=patience.seconds(3)
    )
    assert result.returncode == 1 and "RuntimeError: stopped" in result.stderr, result.stderr
    assert_steps(tmp_path / "interrupted.h5", 21)
    assert_steps(tmp_path / "failed.h5", 13)
