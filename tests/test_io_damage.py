"""A damaged log fails within seconds, with a message that says so, instead of hanging.

In SWMR mode HDF5 retried a failing metadata read with exponentially growing
sleeps: `GradientLog` and every command line hung on these files, using no CPU.
The reads run in a child process, so a hang fails the test instead of the suite.
"""

import json
import re
import shutil

import numpy as np
import patience
import pytest
from helpers_io import run_child
from test_analysis import write_log

# Each damaged open waits about a second for HDF5's retries (io/read_access.py), and
# works for up to two more on the quiet machine, longer on a slower or busier one.
SECONDS_PER_OPEN = 1.0 + 2.0 * patience.slowdown()


def damage(good, path, kind):
    shutil.copy(good, path)
    data = bytearray(path.read_bytes())
    if kind == "half":
        del data[len(data) // 2 :]
    elif kind == "1KiB":
        del data[1024:]
    else:
        # Garbage over a dataset's object header, in the middle of the file's structure.
        headers = [match.start() for match in re.finditer(b"OHDR", data)]
        start = headers[len(headers) // 2]
        data[start : start + 1024] = np.random.default_rng(0).bytes(1024)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    directory = tmp_path_factory.mktemp("damaged")
    good = write_log(directory / "good.h5", num_examples=160, epochs=4).path
    paths = {}
    for kind in ("half", "1KiB", "garbage"):
        paths[kind] = directory / f"{kind}.h5"
        damage(good, paths[kind], kind)
    return paths


def outcomes(calls):
    """Runs `calls` (lines of Python, each ending in a damaged read) in a child process;
    returns, per call, the seconds it took and the error it raised."""
    code = """
        import contextlib, io, json, time
        from keras_gradtrack import cli
        from keras_gradtrack.analysis import GradientLog
        for call in CALLS:
            start = time.monotonic()
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    status = eval(call)
                error = stderr.getvalue() if status else None
            except Exception as raised:
                error = f"{type(raised).__name__}: {raised}"
            print(json.dumps([time.monotonic() - start, error]), flush=True)
        """.replace("CALLS", repr(calls))
    returncode, stdout, stderr = run_child(code)
    assert returncode == 0, stderr
    return [json.loads(line) for line in stdout.splitlines()]


def test_a_damaged_log_is_reported_by_gradient_log_within_seconds(damaged):
    calls = [f"GradientLog({str(path)!r}).per_example('loss')" for path in damaged.values()]
    results = dict(zip(damaged, outcomes(calls)))
    for kind, (seconds, error) in results.items():
        assert seconds < SECONDS_PER_OPEN, kind
        assert error.startswith("OSError: Cannot read the gradient log"), (kind, error)
        assert "it is damaged" in error and "copy it again" in error, (kind, error)
    assert "it holds 1024 of the" in results["1KiB"][1]  # how much is missing


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["half", "1KiB", "garbage"])
def test_every_command_reports_a_damaged_log_in_one_line(damaged, kind):
    path = str(damaged[kind])
    commands = [["summary", path], ["top", path], ["export", path, "--out", path + "_csv"]]
    commands += [["watch", path, "--count", "1"], ["plot", path, "--out", path + "_png"]]
    for (seconds, error), command in zip(
        outcomes([f"cli.main({command!r})" for command in commands]), commands
    ):
        assert seconds < SECONDS_PER_OPEN, command
        assert error.startswith("keras-gradtrack: error: Cannot read the gradient log"), error
        assert len(error.splitlines()) == 1 and "it is damaged" in error, error
