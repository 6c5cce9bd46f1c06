"""Child process of tests/test_reliability.py: writes a log and reports its progress.

Run as `python tests/reliability_worker.py MODE ...`. It prints one JSON object per
line on stdout, so the test can tell what reached the file before it kills the
process or looks at the file.

* `train PATH [options]`: fits a small `GradientTrackingModel` with an
  `HDF5GradientLogger`; prints `{"event": "flushed", "through_step": s}` after every
  block written (in the logger's writer thread or at its close), `{"event": "epoch", "epoch": e}` after every epoch, then
  `{"event": "done"}`, or `{"event": "error", ...}` (and exits with 3) if `fit`
  raised an OSError. `--file-size-slack N` then limits the size of any file the
  process writes (RLIMIT_FSIZE) to the log's size after its first block + N bytes,
  as a disk that fills up.
* `sweep DIR --fault kill|full`: does not import TensorFlow. Runs one `LogWriter`
  scenario per write system call, each in a forked child, with the library the test
  preloads (LD_PRELOAD, `KGT_SHIM` names it) told to fail that call: `kill` sends
  SIGKILL there, `full` makes it and every later write that grows a file fail with
  ENOSPC. Run n writes `DIR/n.h5` and `DIR/n.jsonl` (the steps it saw flushed, the
  error it got) and prints `{"event": "run", "n": n, "killed": bool}`; the sweep ends
  with the first run the fault no longer reaches.
"""

import argparse
import ctypes
import itertools
import json
import os
import resource
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
FAULTS = {"kill": 0, "full": 1}
# The sweep's scenario: a new log, closed, then continued with append=True.
FIRST_RUN_BATCHES = ([3, 1], [2])  # an explicit flush after each group; close flushes
SECOND_RUN_BATCHES = ([4, 3], [1])


_EMITTING = threading.Lock()


def emit(**event: Any) -> None:
    # One write per line, one thread at a time: the logger's writer thread reports
    # blocks while the main thread reports epochs, and print's separate write of the
    # newline let two events share a line.
    with _EMITTING:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


# -- train --------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as tests/conftest.py
    import keras
    import numpy as np

    import keras_gradtrack as kgt
    from keras_gradtrack.io.writer import LogWriter

    write_block = LogWriter._write_block
    limited = False

    def write_and_report(writer: LogWriter, records: Any) -> None:
        # Every block, written in the logger's background thread or by close().
        nonlocal limited
        write_block(writer, records)
        emit(event="flushed", through_step=writer.last_written_step)
        if args.file_size_slack is not None and not limited:
            limited = True
            limit = os.path.getsize(args.path) + args.file_size_slack
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    LogWriter._write_block = write_and_report  # type: ignore[method-assign]
    # Writes past RLIMIT_FSIZE then fail with EFBIG instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            time.sleep(args.sleep)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            emit(event="epoch", epoch=epoch)

    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(args.examples, 6)).astype("float32")
    y = rng.integers(0, 3, args.examples)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    logger = kgt.HDF5GradientLogger(args.path, flush_every=args.flush_every, flush_seconds=None)
    try:
        model.fit(
            x,
            y,
            batch_size=args.batch_size,
            epochs=args.epochs,
            shuffle=False,
            verbose=0,
            callbacks=[logger, Progress()],
        )
    except OSError as error:
        emit(event="error", type=type(error).__name__, errno=error.errno, message=str(error))
        sys.exit(3)
    emit(event="done")


# -- sweep --------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> None:
    # keras_gradtrack/__init__.py imports TensorFlow; the io package needs none of it,
    # and each forked run must stay cheap.
    package = types.ModuleType("keras_gradtrack")
    package.__path__ = [str(TESTS_DIR.parent / "keras_gradtrack")]
    sys.modules["keras_gradtrack"] = package
    sys.path.insert(0, str(TESTS_DIR))
    from helpers_io import make_writer, write_steps

    shim = ctypes.CDLL(os.environ["KGT_SHIM"])
    shim.failed_writes.restype = ctypes.c_long
    directory = Path(args.directory)

    def scenario(path: Path, report: Any) -> None:
        def flushed(through_step: int) -> None:
            report.write(json.dumps({"flushed": through_step}) + "\n")
            report.flush()

        for append, batches in ((False, FIRST_RUN_BATCHES), (True, SECOND_RUN_BATCHES)):
            with make_writer(path, append=append, flush_every=100) as writer:
                write_steps(writer, batches[0])
                writer.flush()
                flushed(writer.last_step)
                write_steps(writer, batches[1])
                last_step = writer.last_step
            flushed(last_step)  # closed, hence flushed

    for n in itertools.count(1):
        with open(directory / f"{n}.jsonl", "w") as report:
            pid = os.fork()
            if pid == 0:  # the child: fail one write, run the scenario, report
                code = 0
                try:
                    shim.fail_at_write(ctypes.c_long(n), FAULTS[args.fault])
                    try:
                        scenario(directory / f"{n}.h5", report)
                    except OSError as error:
                        report.write(json.dumps({"errno": error.errno, "error": str(error)}))
                        report.write("\n")
                    report.write(json.dumps({"failed_writes": shim.failed_writes()}) + "\n")
                    report.flush()
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        emit(event="run", n=n, killed=killed, exit_code=os.waitstatus_to_exitcode(status))
        if not killed:
            with open(directory / f"{n}.jsonl") as report:
                lines = [json.loads(line) for line in report]
            if args.fault == "kill" or not any(line.get("failed_writes") for line in lines):
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    train_parser = modes.add_parser("train")
    train_parser.add_argument("path")
    train_parser.add_argument("--epochs", type=int, default=1)
    train_parser.add_argument("--examples", type=int, default=64)
    train_parser.add_argument("--batch-size", type=int, default=8)
    train_parser.add_argument("--flush-every", type=int, default=2)
    train_parser.add_argument("--sleep", type=float, default=0.0, help="seconds per batch")
    train_parser.add_argument("--seed", type=int, default=0)
    train_parser.add_argument("--file-size-slack", type=int, default=None)
    sweep_parser = modes.add_parser("sweep")
    sweep_parser.add_argument("directory")
    sweep_parser.add_argument("--fault", choices=sorted(FAULTS), required=True)
    args = parser.parse_args()
    if args.mode == "train":
        train(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
