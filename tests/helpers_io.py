"""Shared pieces of the io tests: a small log layout, fake steps, child processes."""

import concurrent.futures
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import patience

from keras_gradtrack.io import LogWriter

LAYERS = ["dense", "dense_1", "head"]
PER_EXAMPLE = {"loss": None, "layer_grad_norm": len(LAYERS)}
PER_STEP = {"batch_grad_norm": None, "layer_batch_grad_norm": len(LAYERS)}
ATTRS = {
    "library_version": "0.1.0",
    "keras_version": "3.0.0",
    "tensorflow_version": "2.16.0",
    "model_name": "mlp",
}

TESTS_DIR = Path(__file__).resolve().parent
# Child processes import keras_gradtrack.io without running keras_gradtrack/__init__.py,
# which imports TensorFlow (seconds per process); the io modules must not need it.
_CHILD_PRELUDE = f"""
import sys, types
package = types.ModuleType("keras_gradtrack")
package.__path__ = [{str(TESTS_DIR.parent / "keras_gradtrack")!r}]
sys.modules["keras_gradtrack"] = package
sys.path.insert(0, {str(TESTS_DIR)!r})
"""


def make_writer(path: Path, **overrides: Any) -> LogWriter:
    """A `LogWriter` for the test layout; keyword arguments replace the defaults."""
    arguments = {
        "layer_names": LAYERS,
        "per_example": PER_EXAMPLE,
        "per_step": PER_STEP,
        "attrs": ATTRS,
        **overrides,
    }
    return LogWriter(path, **arguments)


def fake_step(step: int, batch_size: int, *, epoch: int = 0) -> dict[str, Any]:
    """Keyword arguments of `LogWriter.write_step` with random statistics."""
    rng = np.random.default_rng(step)
    return {
        "step": step,
        "epoch": epoch,
        "example_ids": np.arange(batch_size) + 1000 * step,
        "per_example": {
            "loss": rng.normal(size=batch_size),
            "layer_grad_norm": rng.normal(size=(batch_size, len(LAYERS))),
        },
        "per_step": {
            "batch_grad_norm": float(rng.normal()),
            "layer_batch_grad_norm": rng.normal(size=len(LAYERS)),
        },
    }


def next_file_step(writer: LogWriter) -> int:
    """The step number the file gives the writer's next step."""
    return writer.step_offset if writer.last_step is None else writer.last_step + 1


def write_steps(writer: LogWriter, batch_sizes: list[int], *, epoch: int = 0) -> list[dict]:
    """Writes one fake step per batch size after the writer's last one.

    Returns:
        The steps, numbered as the file numbers them (the writer is given its own
        numbering, from 0 at opening).
    """
    steps = []
    for batch_size in batch_sizes:
        step = fake_step(next_file_step(writer), batch_size, epoch=epoch)
        writer.write_step(**{**step, "step": step["step"] - writer.step_offset})
        steps.append(step)
    return steps


def expected_tables(steps: list[dict]) -> tuple[dict, dict]:
    """The per-example and per-step columns a log of `steps` holds, as float32."""
    per_example = {
        "step": np.concatenate([np.full(len(s["example_ids"]), s["step"]) for s in steps]),
        "epoch": np.concatenate([np.full(len(s["example_ids"]), s["epoch"]) for s in steps]),
        "example_id": np.concatenate([s["example_ids"] for s in steps]),
    }
    per_step = {
        "step": np.array([s["step"] for s in steps]),
        "epoch": np.array([s["epoch"] for s in steps]),
        "batch_size": np.array([len(s["example_ids"]) for s in steps]),
    }
    for name in PER_EXAMPLE:
        per_example[name] = np.concatenate([s["per_example"][name] for s in steps])
    for name in PER_STEP:
        per_step[name] = np.stack([np.asarray(s["per_step"][name]) for s in steps])
    for table in (per_example, per_step):
        for name in (*PER_EXAMPLE, *PER_STEP):
            if name in table:
                table[name] = table[name].astype(np.float32)
    return per_example, per_step


@contextlib.contextmanager
def child_process(code: str) -> Iterator[subprocess.Popen]:
    """A Python child running `code`, talking over text stdin/stdout; killed on exit."""
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            yield child
        finally:
            child.kill()


def read_line(child: subprocess.Popen, timeout: float | None = None) -> str:
    """The child's next stdout line; fails with its stderr if none comes in time
    (`timeout`, default: `patience.seconds()`)."""
    assert child.stdout is not None and child.stderr is not None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        try:
            line = executor.submit(child.stdout.readline).result(
                timeout=patience.seconds() if timeout is None else timeout
            )
        except concurrent.futures.TimeoutError:
            child.kill()
            line = ""
    if not line:
        child.kill()
        raise AssertionError(f"The child process wrote no line. Its stderr:\n{child.stderr.read()}")
    return line.strip()


def run_child(code: str) -> tuple[int, str, str]:
    """Runs a Python child to completion; returns its exit code, stdout and stderr."""
    with child_process(code) as child:
        stdout, stderr = child.communicate(timeout=patience.seconds())
    return child.returncode, stdout, stderr
