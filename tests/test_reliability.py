"""The log survives what real training meets: kills, live readers, full disks, bad input.

Most of these run a writer in another process: `tests/reliability_worker.py` trains a
small model (or, with no TensorFlow, replays a `LogWriter` scenario) and reports on
stdout which blocks reached the file, so the test knows what must be there after it
kills the process or the disk fills up. docs/reliability.md lists every guarantee
and the test that checks it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import patience
import pytest
from helpers_io import expected_tables, fake_step, make_writer, write_steps

import keras_gradtrack as kgt
from keras_gradtrack.io import LogReader, LogWriter, schema

WORKER = Path(__file__).resolve().parent / "reliability_worker.py"
# Five workers start together: each imports TensorFlow on cores the others share.
WORKER_IMPORTS = 6

# Preloaded into the sweep's processes: fails one chosen write system call of HDF5.
# Between system calls nothing reaches the file, so failing each one in turn covers
# every moment a writer can be killed or find the disk full.
SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static long target = 0;  /* the write system call that fails, counted from 1; 0: none */
static int fault = 0;    /* 0: SIGKILL at it; 1: it and later writes growing a file: ENOSPC */
static long seen = 0, failed = 0;

void fail_at_write(long n, int how) { target = n; fault = how; seen = 0; failed = 0; }
long failed_writes(void) { return failed; }

static int grows_a_file(int fd, off_t end) {
    char link[64], name[256];
    struct stat status;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, name, sizeof name - 1);
    if (length > 0) {
        name[length] = 0;
        if (strncmp(name, "/memfd:", 7) == 0) return 0;  /* memory, not the disk */
    }
    return fstat(fd, &status) == 0 && end > status.st_size;
}

static int fails(int fd, off_t end, int may_be_full) {
    if (target <= 0) return 0;
    ++seen;
    if (fault == 0) {
        if (seen == target) raise(SIGKILL);
        return 0;
    }
    if (may_be_full && seen >= target && grows_a_file(fd, end)) {
        ++failed;
        errno = ENOSPC;
        return 1;
    }
    return 0;
}

ssize_t pwrite(int fd, const void *buffer, size_t size, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite");
    return fails(fd, offset + (off_t)size, 1) ? -1 : real(fd, buffer, size, offset);
}

ssize_t pwrite64(int fd, const void *buffer, size_t size, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite64");
    return fails(fd, offset + (off_t)size, 1) ? -1 : real(fd, buffer, size, offset);
}

/* Growing a file with ftruncate allocates nothing, so a full disk allows it. */
int ftruncate(int fd, off_t length) {
    static int (*real)(int, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "ftruncate");
    fails(fd, length, 0);
    return real(fd, length);
}
"""


# -- helpers ------------------------------------------------------------------------


class Worker:
    """`reliability_worker.py` in a child process; its JSON lines are read as they come.

    Use as a context manager: the process is killed and its pipes closed on exit.
    """

    def __init__(self, *arguments: str, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.kill()
        self.finish()

    def _read_events(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)  # end of output

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self._stderr.extend(self.process.stderr)

    def next_event(self) -> dict[str, Any]:
        try:
            event = self.events.get(timeout=patience.seconds(WORKER_IMPORTS))
        except queue.Empty:
            self.process.kill()
            raise AssertionError(f"The worker went silent. Its stderr:\n{self.stderr}") from None
        if event is None:
            self.events.put(None)
            self.finish()
            raise AssertionError(f"The worker ended. Its stderr:\n{self.stderr}")
        self.seen.append(event)
        return event

    def wait_for(self, name: str) -> dict[str, Any]:
        while (event := self.next_event())["event"] != name:
            pass
        return event

    def drain(self) -> None:
        """Takes in every event printed so far, without waiting."""
        while not self.events.empty() and self.events.queue[0] is not None:
            self.next_event()

    def flushed_through(self) -> int:
        """The last step the worker reported written to the file; -1 if none."""
        flushed = [e["through_step"] for e in self.seen if e["event"] == "flushed"]
        return max(flushed, default=-1)

    def finish(self) -> int:
        """Waits for the process to end and takes in all its output; its exit code."""
        try:
            self.process.wait(timeout=patience.seconds(WORKER_IMPORTS))
            for reader in self._readers:
                reader.join(timeout=patience.seconds())
            while (event := self.events.get_nowait()) is not None:
                self.seen.append(event)
            self.events.put(None)
        finally:
            # Closed even when the worker misbehaved: an open pipe found by the garbage
            # collector fails whichever test runs then (ResourceWarning).
            for pipe in (self.process.stdout, self.process.stderr):
                assert pipe is not None
                pipe.close()
        return self.process.returncode

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)


def table_lengths(file: h5py.File) -> dict[str, list[int]]:
    """The row count of every dataset, per table."""
    return {table: [d.shape[0] for d in file[table].values()] for table in schema.TABLES}


def assert_holds_steps(path: Path, through_step: int, batch_size: int, flush_every: int) -> int:
    """Checks the log of a `train` worker: plain h5py (swmr=True) and LogReader open
    it, and the rows common to each table's datasets hold every step up to
    `through_step`, complete and in order. Returns the number of such steps."""
    with h5py.File(path, "r", swmr=True) as file:
        lengths = table_lengths(file)
        num_steps = min(lengths["per_step"])
        steps = file["per_step/step"][:num_steps]
        np.testing.assert_array_equal(steps, np.arange(num_steps))
        assert num_steps >= through_step + 1
        num_examples = min(lengths["per_example"])
        assert num_examples >= batch_size * (through_step + 1)
        np.testing.assert_array_equal(
            file["per_example/step"][:num_examples],
            np.repeat(np.arange(num_steps), batch_size)[:num_examples],
        )
        for name in ("loss", "grad_norm", "cosine"):
            assert np.isfinite(file["per_example"][name][:num_examples]).all(), name
        # A kill inside HDF5's flush may leave some datasets one block ahead; never
        # more, and never a partial block.
        for table, rows_per_step in (("per_example", batch_size), ("per_step", 1)):
            extra = {length - min(lengths[table]) for length in lengths[table]}
            assert extra <= {0, rows_per_step * flush_every}, (table, lengths[table])
    with LogReader(path) as log:
        assert log.num_steps >= through_step + 1
        assert len(log.per_example("example_id")) == log.num_examples
    return num_steps


# -- 1. crash safety ----------------------------------------------------------------


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux and a C compiler to preload a write-failing shim")
    directory = tmp_path_factory.mktemp("shim")
    (directory / "shim.c").write_text(SHIM_SOURCE)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", "shim.so", "shim.c", "-ldl"],
        cwd=directory,
        check=True,
        capture_output=True,
    )
    return directory / "shim.so"


def run_sweep(shim: Path, directory: Path, fault: str) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "LD_PRELOAD": str(shim), "KGT_SHIM": str(shim)}
    with Worker("sweep", str(directory), "--fault", fault, env=env) as worker:
        assert worker.finish() == 0, worker.stderr
    runs = [event for event in worker.seen if event["event"] == "run"]
    return runs, worker.stderr


def sweep_steps() -> tuple[list[dict[str, Any]], dict[str, set[int]]]:
    """The steps the sweep's scenario writes, and per table the row counts at which
    one of its blocks ends."""
    sys.path.insert(0, str(WORKER.parent))
    from reliability_worker import FIRST_RUN_BATCHES, SECOND_RUN_BATCHES

    blocks = [*FIRST_RUN_BATCHES, *SECOND_RUN_BATCHES]
    sizes = [size for block in blocks for size in block]
    steps = [fake_step(step, size) for step, size in enumerate(sizes)]
    boundaries = {
        "per_example": set(np.cumsum([0] + [sum(block) for block in blocks]).tolist()),
        "per_step": set(np.cumsum([0] + [len(block) for block in blocks]).tolist()),
    }
    return steps, boundaries


def read_report(path: Path) -> tuple[int, dict[str, Any] | None]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    flushed = max((line["flushed"] for line in lines if "flushed" in line), default=-1)
    errors = [line for line in lines if "error" in line]
    return flushed, errors[0] if errors else None


def check_sweep_file(path: Path, flushed: int) -> dict[str, set[int]]:
    """What every run of the sweep must leave; returns the raw lengths seen per table."""
    steps, boundaries = sweep_steps()
    per_example, per_step = expected_tables(steps)
    with h5py.File(path, "r", swmr=True) as file:
        lengths = table_lengths(file)
        for table, expected in (("per_example", per_example), ("per_step", per_step)):
            for name, dataset in file[table].items():
                values = dataset[:]
                # Every row any dataset shows is a real row: no fill values, ever.
                np.testing.assert_array_equal(values, expected[name][: len(values)], err_msg=name)
                assert len(values) in boundaries[table], (table, name, len(values))
        assert min(lengths["per_step"]) >= flushed + 1
    with LogReader(path) as log:
        assert log.num_steps >= flushed + 1
        np.testing.assert_array_equal(log.per_step("step"), np.arange(log.num_steps))
        np.testing.assert_array_equal(
            log.per_example("loss"), per_example["loss"][: log.num_examples]
        )
    return {table: set(values) for table, values in lengths.items()}


@pytest.mark.slow
def test_a_writer_killed_at_any_write_leaves_a_readable_log(shim: Path, tmp_path: Path) -> None:
    runs, _ = run_sweep(shim, tmp_path, "kill")
    steps, _ = sweep_steps()
    assert len(runs) > 40 and all(run["killed"] for run in runs[:-1])
    unequal = 0
    for run in runs:
        n = run["n"]
        flushed, _ = read_report(tmp_path / f"{n}.jsonl")
        path = tmp_path / f"{n}.h5"
        if not path.exists():
            # Killed before the new file was complete: it was never moved into place.
            assert flushed == -1, n
            continue
        lengths = check_sweep_file(path, flushed)
        unequal += any(len(values) > 1 for values in lengths.values())
    final = check_sweep_file(tmp_path / f"{runs[-1]['n']}.h5", len(steps) - 1)
    assert final == {"per_example": {14}, "per_step": {6}}
    # Only leftovers of runs killed while creating the file: hidden names, no log.
    assert all(p.name.startswith(".") for p in tmp_path.glob("*.tmp"))
    print(f"{len(runs)} kill points, {unequal} with a table one block ahead in some datasets")


@pytest.mark.slow
def test_a_full_disk_at_any_write_leaves_every_block_before_it(shim: Path, tmp_path: Path) -> None:
    runs, stderr = run_sweep(shim, tmp_path, "full")
    steps, boundaries = sweep_steps()
    assert len(runs) > 40 and not any(run["killed"] for run in runs)
    # Closing after the error discards what HDF5 could not write: nothing is printed
    # later, when its objects are garbage-collected.
    assert "Exception ignored" not in stderr, stderr
    for run in runs[:-1]:
        n = run["n"]
        path = tmp_path / f"{n}.h5"
        flushed, error = read_report(tmp_path / f"{n}.jsonl")
        assert error is not None and error["errno"] == errno.ENOSPC, (n, error)
        assert str(path) in error["error"] and "No space left on device" in error["error"]
        if not path.exists():
            assert flushed == -1 and "Cannot create the gradient log" in error["error"], n
            continue
        lengths = check_sweep_file(path, flushed)
        # Every dataset holds the same blocks: those before the failed one, and the
        # failed one only if all of it reached the file before the error (otherwise
        # it was rolled back).
        (num_steps,) = lengths["per_step"]
        assert num_steps == flushed + 1 or num_steps in boundaries["per_step"], n
        num_examples = sum(len(step["example_ids"]) for step in steps[:num_steps])
        assert lengths["per_example"] == {num_examples}, n


def test_a_file_appearing_while_the_log_is_made_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.h5"
    writer = make_writer(path)
    # As if another process created the file after check_path looked.
    monkeypatch.setattr(LogWriter, "check_path", lambda *args, **kwargs: path.write_text("x"))
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        writer.open()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]
    assert path.read_text() == "x"


def test_a_new_log_is_made_on_file_systems_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hard_links(source: str, destination: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    with make_writer(tmp_path / "run.h5") as writer:
        steps = write_steps(writer, [2, 1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]
    with LogReader(tmp_path / "run.h5") as log:
        assert log.num_steps == len(steps)


@pytest.mark.slow
def test_training_killed_at_random_moments_keeps_every_flushed_block(tmp_path: Path) -> None:
    """SIGKILL a real `fit` at a random moment after its first block, 3 times."""
    # Every block takes some 20-50 ms here: the delays span dozens of them.
    delays = np.random.default_rng(2024).uniform(0.0, 0.6, size=3)
    batch_size = 8
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(
                Worker(
                    "train",
                    str(tmp_path / f"run{seed}.h5"),
                    "--epochs=1000",
                    f"--batch-size={batch_size}",
                    "--flush-every=2",
                    # A short pause per step leaves the CPU to the workers still starting.
                    "--sleep=0.005",
                    f"--seed={seed}",
                )
            )
            for seed in range(len(delays))
        ]
        reported = []
        for worker, delay in zip(workers, delays):
            worker.wait_for("flushed")
            time.sleep(delay)
            worker.drain()
            reported.append(worker.flushed_through())
            worker.process.send_signal(signal.SIGKILL)
            assert worker.finish() == -signal.SIGKILL, worker.stderr
    for seed, flushed in enumerate(reported):
        assert_holds_steps(tmp_path / f"run{seed}.h5", flushed, batch_size, flush_every=2)


# -- 2. live reading ----------------------------------------------------------------


@pytest.mark.slow
def test_a_reader_sees_the_rows_grow_while_fit_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    arguments = ["--epochs=3", "--examples=32", "--flush-every=1", "--sleep=0.05"]
    with Worker("train", str(path), *arguments) as worker:
        worker.wait_for("flushed")
        seen_steps = []
        with LogReader(path) as log:
            while worker.process.poll() is None:
                log.refresh()
                steps = log.per_step("step")
                # Columns read together after a refresh always have equal lengths.
                assert len(log.per_example("cosine")) == len(log.per_example("step"))
                assert len(log.per_step("noise_scale")) == len(steps)
                np.testing.assert_array_equal(steps, np.arange(len(steps)))
                seen_steps.append(len(steps))
                time.sleep(0.02)
            assert worker.finish() == 0, worker.stderr
            log.refresh()
            assert (log.num_steps, log.num_examples) == (12, 96)
    # The reader saw the log grow, never shrink, through several sizes.
    assert seen_steps == sorted(seen_steps)
    assert len(set(seen_steps)) >= 3, seen_steps
    with h5py.File(path, "r") as file:  # closed cleanly: plain h5py, no swmr needed
        assert file["per_step/step"].shape == (12,)


# -- 3. bad input and a hostile environment -------------------------------------------

X = np.random.default_rng(5).normal(size=(16, 6)).astype("float32")
Y = np.random.default_rng(6).integers(0, 3, 16)


def small_model(loss: Any = None, activation: str = "relu") -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation=activation)(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer="sgd",
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit_fails_before_training(model: Any, logger: Any, error: type, match: str) -> None:
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=8, verbose=0, callbacks=[logger])
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_append_to_a_log_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    small_model().fit(X, Y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    with h5py.File(path, "r+") as file:
        file.attrs["schema_version"] = 3
    before = path.read_bytes()
    fit_fails_before_training(
        small_model(),
        kgt.HDF5GradientLogger(path, append=True),
        ValueError,
        r"unsupported schema version.*Received: schema_version=3",
    )
    assert path.read_bytes() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /sys and /proc")
@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        # sysfs refuses new files even to root, for whom os.access says yes.
        ("/sys/kernel/run.h5", PermissionError, "'/sys/kernel' is not writable"),
        # procfs says "no such file"; the error names the directory, not a probe file.
        ("/proc/run.h5", OSError, r"Cannot create the log file in '/proc': No such file"),
    ],
)
def test_a_directory_that_takes_no_new_file_is_refused_before_training(
    path: str, error: type, match: str
) -> None:
    logger = kgt.HDF5GradientLogger(path)
    fit_fails_before_training(small_model(), logger, error, match)


@contextlib.contextmanager
def mounted(name: str, *commands: list[str]) -> Iterator[Path]:
    """Runs `mount` commands onto a fresh directory; skips where mounting is refused.

    The mount point lives outside pytest's temporary tree, and is detached lazily:
    a mount left behind there would break pytest's own clean-up in later sessions.
    """
    target = Path(tempfile.mkdtemp(prefix=f"kgt-{name}-"))
    try:
        for command in commands:
            result = subprocess.run(
                ["mount", *command, str(target)], capture_output=True, text=True
            )
            if result.returncode != 0:
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
                pytest.skip(f"cannot mount here (needs root): {result.stderr.strip()}")
        try:
            yield target
        finally:
            subprocess.run(["umount", "-l", str(target)], check=True)
    finally:
        target.rmdir()


@pytest.mark.skipif(shutil.which("mount") is None, reason="needs mount")
def test_a_read_only_file_system_is_refused_before_training(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    small_model().fit(X, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(source / "old.h5")])
    bind = ["--bind", str(source)]
    with mounted("read-only", bind, ["-o", "remount,ro,bind"]) as directory:
        for name, flags in (("new.h5", {}), ("old.h5", {"append": True})):
            logger = kgt.HDF5GradientLogger(directory / name, **flags)
            fit_fails_before_training(small_model(), logger, PermissionError, "not writable")
    assert sorted(p.name for p in source.iterdir()) == ["old.h5"]


def fill_up(directory: Path) -> None:
    """Writes a file in `directory` until the file system is full."""
    descriptor = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(descriptor, b"x" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(descriptor)


@pytest.mark.skipif(shutil.which("mount") is None, reason="needs mount")
def test_a_full_disk_ends_fit_with_a_clear_error_and_keeps_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed_through = []
    write_block = LogWriter._write_block

    def write_and_record(writer: Any, records: Any) -> None:
        write_block(writer, records)  # in the logger's writer thread, or at its close
        flushed_through.append(writer.last_written_step)

    monkeypatch.setattr(LogWriter, "_write_block", write_and_record)

    class FillTheDiskAfterTheFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:
                fill_up(directory)

    with mounted("disk", ["-t", "tmpfs", "-o", "size=256k", "tmpfs"]) as directory:
        path = directory / "run.h5"
        logger = kgt.HDF5GradientLogger(path, flush_every=2, flush_seconds=None)
        model = small_model()
        with pytest.raises(OSError, match="No space left on device") as raised:
            model.fit(
                X,
                Y,
                batch_size=8,
                epochs=200,
                verbose=0,
                callbacks=[logger, FillTheDiskAfterTheFirstEpoch()],
            )
        assert raised.value.errno == errno.ENOSPC
        assert f"Cannot write the gradient log '{path}'" in str(raised.value)
        assert logger.writer is None  # closed: nothing left open or buffered
        (directory / "filler").unlink()
        # Every block written before the failed one, and nothing of that one.
        with h5py.File(path, "r", swmr=True) as file:
            lengths = table_lengths(file)
        with LogReader(path) as log:
            assert log.num_steps == flushed_through[-1] + 1 >= 2
            np.testing.assert_array_equal(log.per_step("step"), np.arange(log.num_steps))
            assert lengths == {
                "per_example": [log.num_examples] * len(lengths["per_example"]),
                "per_step": [log.num_steps] * len(lengths["per_step"]),
            }


@pytest.mark.slow
def test_a_file_size_limit_ends_fit_with_a_clear_error_and_keeps_the_log(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG) stands for a full disk where mounting a small one is refused."""
    path = tmp_path / "run.h5"
    arguments = ["--epochs=100", "--flush-every=1", "--file-size-slack=4096"]
    with Worker("train", str(path), *arguments) as worker:
        assert worker.finish() == 3, worker.stderr
    error = worker.seen[-1]
    assert error["event"] == "error" and error["errno"] == errno.EFBIG, error
    assert error["message"] == (
        f"[Errno 27] Cannot write the gradient log '{path}': File too large. "
        "The file keeps every block written before this one."
    )
    flushed = worker.flushed_through()
    assert flushed >= 1
    num_steps = assert_holds_steps(path, flushed, batch_size=8, flush_every=1)
    # The failed block (one step) was rolled back, unless all of it reached the file.
    assert num_steps in (flushed + 1, flushed + 2)
    with h5py.File(path, "r", swmr=True) as file:
        assert {table: set(lengths) for table, lengths in table_lengths(file).items()} == {
            "per_example": {8 * num_steps},
            "per_step": {num_steps},
        }


@pytest.mark.parametrize(
    ("bad_value", "terminate_on_nan"),
    [(np.nan, False), (np.inf, False), (np.nan, True)],
    ids=["nan", "inf", "nan-TerminateOnNaN"],
)
def test_nan_and_inf_gradients_are_logged_as_they_are(
    tmp_path: Path, bad_value: float, terminate_on_nan: bool
) -> None:
    x, y = X.copy(), np.eye(3, dtype="float32")[Y]
    if np.isnan(bad_value):
        x[3, 0] = np.nan  # example 3's loss and gradient are NaN, then so is G
    else:
        y[3, 0] = 1e30  # its squared error overflows float32: loss inf
    # tanh passes NaN on; relu may not (oneDNN's relu maps NaN to 0).
    model = small_model(loss="mse", activation="tanh")
    callbacks = [kgt.HDF5GradientLogger(tmp_path / "run.h5", flush_every=3)]
    if terminate_on_nan:
        callbacks.append(keras.callbacks.TerminateOnNaN())
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    # As plain Keras: training goes on through NaN and inf unless told to stop.
    assert len(history.history["loss"]) == (1 if terminate_on_nan else 3)
    with LogReader(tmp_path / "run.h5") as log:
        assert log.num_steps == (1 if terminate_on_nan else 6)
        loss = log.per_example("loss")
        assert np.isfinite(loss[[0, 1, 2, 4, 5, 6, 7]]).all()
        if np.isnan(bad_value):
            assert np.isnan(loss[3]) and np.isnan(log.per_example("grad_norm")[3])
        else:
            assert loss[3] == np.inf
        assert not np.isfinite(log.per_step("batch_grad_norm")[0])
