"""The command line's output is only its own: no traceback or error when its reader
stops early (`| head`), no TensorFlow start-up lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_analysis import write_log

from keras_gradtrack import cli

ROOT = Path(__file__).resolve().parent.parent


def command(*argv: object) -> list[str]:
    return [sys.executable, "-m", "keras_gradtrack.cli", *map(str, argv)]


def environment() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path) -> None:
    # 3000 ids: the table (over 100 KiB) outgrows the pipe's buffer, so writing it fails.
    path = write_log(tmp_path / "big.h5", num_examples=3000, epochs=1, batch_size=500).path
    with subprocess.Popen(
        command("top", path, "-k", 3000),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(),
    ) as reader:
        assert reader.stdout is not None and reader.stderr is not None
        first = reader.stdout.readline()
        reader.stdout.close()  # as `head -1` does
        status = reader.wait(timeout=120)
        stderr = reader.stderr.read().decode()
    assert first.split() == [b"rank", b"example_id", b"self_influence", b"rows"]
    assert stderr == ""
    assert status == cli.BROKEN_PIPE_STATUS


@pytest.mark.slow
def test_the_tensorboard_command_prints_no_tensorflow_start_up_lines(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    path = write_log(tmp_path / "run.h5").path
    env = {k: v for k, v in environment().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(
        command("tensorboard", path, "--logdir", tmp_path / "tb"),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0
    assert result.stderr == ""
    assert result.stdout.splitlines()[0] == str(tmp_path / "tb")
