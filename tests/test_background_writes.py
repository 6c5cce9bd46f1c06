"""Blocks written on a thread of their own: the same file, errors raised where training runs.

`HDF5GradientLogger` writes its blocks with `background=True`: a due block is handed to
a thread and the training thread goes on; the next block, `flush()` and `close()` wait
for it, and a block that fails there is raised by the caller's next call.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest
from helpers_io import expected_tables, fake_step, make_writer, next_file_step, write_steps

import keras_gradtrack as kgt
from keras_gradtrack.io import LogReader, LogWriter, block_writer, blocks

X = np.random.default_rng(3).normal(size=(64, 6)).astype("float32")
Y = np.random.default_rng(4).integers(0, 3, 64)


def assert_log_holds(path: Path, steps: list[dict]) -> None:
    per_example, per_step = expected_tables(steps)
    with LogReader(path) as log:
        for name, values in per_example.items():
            np.testing.assert_array_equal(log.per_example(name), values, err_msg=name)
        for name, values in per_step.items():
            np.testing.assert_array_equal(log.per_step(name), values, err_msg=name)


class Gate:
    """Replaces `append_block`: each block waits until `open_gate`, or fails with `error`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: BaseException | None = None):
        self.append_block = block_writer.append_block
        self.error = error
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        monkeypatch.setattr(block_writer, "append_block", self)

    def __call__(self, *args: Any) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        self.opened.wait(timeout=patience.seconds())
        self.append_block(*args)


def test_background_blocks_hold_what_the_foreground_writes(tmp_path: Path) -> None:
    batches = [3, 1, 4, 1, 5, 9, 2, 6]
    steps = {}
    for background in (False, True):
        path = tmp_path / f"{background}.h5"
        with make_writer(path, flush_every=3, background=background) as writer:
            steps[background] = write_steps(writer, batches)
        assert_log_holds(path, steps[background])
    assert [s["step"] for s in steps[True]] == [s["step"] for s in steps[False]]


def test_a_due_block_is_written_while_the_caller_goes_on_and_close_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    path = tmp_path / "run.h5"
    writer = make_writer(path, flush_every=2, flush_seconds=None, background=True)
    writer.open()
    steps = write_steps(writer, [2, 3, 4])  # the block of steps 0 and 1 is due, not written
    assert gate.entered.wait(timeout=patience.seconds())
    assert gate.threads == ["keras_gradtrack writer of " + str(path)]
    assert writer.last_written_step is None and writer.last_step == 2
    gate.opened.set()
    writer.close()  # waits for the block, then writes step 2 itself
    assert gate.threads[1] == threading.current_thread().name
    assert_log_holds(path, steps)


def test_a_failed_background_block_is_raised_by_the_next_step_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    gate = Gate(monkeypatch, error=full)
    gate.opened.set()
    path = tmp_path / "run.h5"
    writer = make_writer(path, flush_every=2, flush_seconds=None, background=True)
    writer.open()
    steps = write_steps(writer, [2, 3])  # the first block fails on the writer thread
    with pytest.raises(OSError, match=f"Cannot write the gradient log '{path}'") as raised:
        for _ in range(4):  # the thread may still run: the error comes by the next block
            steps.append(fake_step(next_file_step(writer), 1))
            writer.write_step(**steps[-1])  # buffered, then the error raised
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.__cause__ is full
    assert gate.threads[0].startswith("keras_gradtrack writer of")
    writer.close()  # the failed block was buffered again: every step reaches the file
    assert_log_holds(path, steps)


def test_an_unexpected_error_on_the_writer_thread_says_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Gate(monkeypatch, error=ValueError("a broken block")).opened.set()
    writer = make_writer(tmp_path / "run.h5", flush_every=1, background=True)
    writer.open()
    write_steps(writer, [2])
    with pytest.raises(RuntimeError, match="in the background failed: ValueError: a broken block"):
        writer.flush()
    writer.close()
    with LogReader(tmp_path / "run.h5") as log:
        assert log.num_steps == 1


def test_fit_ends_with_the_writer_threads_error_and_the_log_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[int | None] = []
    threads: list[str] = []
    write_block = LogWriter._write_block

    def fail_after_two_blocks(writer: Any, block: Any) -> None:
        threads.append(threading.current_thread().name)
        if len(written) == 2:
            raise OSError(errno.EFBIG, "File too large")
        write_block(writer, block)
        written.append(writer.last_written_step)

    monkeypatch.setattr(LogWriter, "_write_block", fail_after_two_blocks)
    inputs = keras.Input((6,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", flush_every=2, flush_seconds=None)
    with pytest.raises(OSError, match="File too large") as raised:
        model.fit(X, Y, batch_size=8, epochs=5, verbose=0, callbacks=[logger])
    assert raised.value.errno == errno.EFBIG
    assert logger.writer is None
    # The logger's blocks were written on its writer thread; the retry at close is not.
    writer_thread = f"keras_gradtrack writer of {tmp_path / 'run.h5'}"
    assert threads == [writer_thread] * 3 + [threading.current_thread().name]
    with LogReader(tmp_path / "run.h5") as log:  # the two blocks before the failed one
        assert written == [1, 3] and log.num_steps == 4


def test_steps_given_unchecked_are_checked_on_the_writer_thread_into_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked_on: list[str] = []
    record_of = blocks.record_of

    def recorded(*args: Any) -> Any:
        checked_on.append(threading.current_thread().name)
        return record_of(*args)

    monkeypatch.setattr(blocks, "record_of", recorded)
    monkeypatch.setattr(block_writer, "record_of", recorded)
    batches = [3, 1, 4, 1, 5, 9, 2]
    files = {}
    for checked in (True, False):
        path = files[checked] = tmp_path / f"{checked}.h5"
        checked_on.clear()
        with make_writer(path, flush_every=3, flush_seconds=None, background=True) as writer:
            for batch_size in batches:
                writer.write_step(**fake_step(next_file_step(writer), batch_size), checked=checked)
        main = threading.current_thread().name
        if checked:
            assert checked_on == [main] * len(batches)
        else:  # the first step at once, the others with their block on its thread
            assert checked_on[0] == main and len(checked_on) == len(batches)
            assert checked_on.count(f"keras_gradtrack writer of {path}") == 5
    steps = [fake_step(step, batch_size) for step, batch_size in enumerate(batches)]
    assert_log_holds(files[False], steps)
    assert_log_holds(files[True], steps)


@pytest.mark.parametrize("background", [False, True])
def test_an_unchecked_step_that_does_not_fit_fails_its_block_before_the_file(
    tmp_path: Path, background: bool
) -> None:
    path = tmp_path / "run.h5"
    writer = make_writer(path, flush_every=2, flush_seconds=None, background=background)
    writer.open()
    first = fake_step(0, 2)
    first["per_example"]["loss"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"per_example\['loss'\] to have shape \(2,\)"):
        writer.write_step(**first, checked=False)  # the first step is checked at once
    steps = [fake_step(step, 2) for step in range(3)]
    steps[2]["per_example"]["loss"] = np.zeros(3)
    for step in steps[:3]:
        writer.write_step(**step, checked=False)  # the bad step is buffered as given
    message = r"Expected per_example\['loss'\] to have shape \(2,\)"
    if background:
        message = "in the background failed: ValueError: " + message
    with pytest.raises(RuntimeError if background else ValueError, match=message):
        for step in range(3, 8):  # its block is due at step 3 (written by the next)
            writer.write_step(**fake_step(step, 2), checked=False)
    with pytest.raises(ValueError, match=r"to have shape \(2,\)"):
        writer.close()  # the failed block was buffered again and fails again
    with LogReader(path) as log:  # the block before it; nothing of the bad block
        assert log.num_steps == 2
        np.testing.assert_array_equal(log.per_step("step"), [0, 1])


def test_a_statistic_of_the_wrong_shape_fails_the_first_step_it_gives(tmp_path: Path) -> None:
    class Pairs(kgt.statistics.Statistic):
        name = "pairs"
        per_example = True
        needs_dot = False

        def compute(self, primitives: Any) -> Any:
            norms = primitives.grad_sq_norm
            return keras.ops.stack([norms, norms], axis=1)

    inputs = keras.Input((6,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss", Pairs()])
    # The logger gives its rows unchecked, but the first step of a file is checked at once.
    with pytest.raises(ValueError, match=r"per_example\['pairs'\] to have shape \(8,\)"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[logger])
    assert model.gradient_tracking.step == 1
