"""Tests of the `keras-gradtrack` command line (keras_gradtrack.cli)."""

import importlib.metadata
import io
import subprocess
import sys
from pathlib import Path

import h5py
import patience
import pytest
from helpers_io import child_process, read_line
from test_analysis import SUSPICIOUS, write_log

from keras_gradtrack import cli
from keras_gradtrack.analysis import GradientLog


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return write_log(tmp_path / "run.h5").path


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_summary_prints_the_log_summary(capsys, log_path):
    status, out, _ = run(capsys, "summary", log_path)
    assert status == 0
    with GradientLog(log_path) as log:
        assert out.strip() == log.summary()
    assert "layers    2: hidden, logits" in out


def test_top_ranks_by_self_influence_or_negative_cosine(capsys, log_path):
    status, out, _ = run(capsys, "top", log_path, "-k", "3")
    lines = out.strip().splitlines()
    assert status == 0 and lines[0].split() == ["rank", "example_id", "self_influence", "rows"]
    assert sorted(int(line.split()[1]) for line in lines[2:]) == sorted(SUSPICIOUS)
    status, out, _ = run(capsys, "top", log_path, "-k", "5", "--by", "negative-cosine")
    with GradientLog(log_path) as log:
        expected = log.most_opposing(5).example_id.tolist()
    assert [int(line.split()[1]) for line in out.strip().splitlines()[2:]] == expected


def test_top_with_a_constant_learning_rate(capsys, tmp_path):
    path = write_log(tmp_path / "no_lr.h5", learning_rate=False).path
    status, _, err = run(capsys, "top", path)
    assert status == 1 and "learning_rate" in err
    status, out, _ = run(capsys, "top", path, "--learning-rate", "0.01", "-k", "2")
    assert status == 0 and len(out.strip().splitlines()) == 4


def test_plot_writes_pngs(capsys, log_path, tmp_path):
    pytest.importorskip("matplotlib")
    status, out, _ = run(capsys, "plot", log_path, "--out", tmp_path / "figures", "--dpi", "30")
    assert status == 0
    written = [Path(line) for line in out.split()]
    assert [path.name for path in written][:2] == ["steps.png", "layer_grad_norm.png"]
    assert all(path.parent == tmp_path / "figures" and path.stat().st_size for path in written)


def test_export_csv_and_parquet(capsys, log_path, tmp_path):
    pandas = pytest.importorskip("pandas")
    status, out, _ = run(capsys, "export", log_path)
    assert status == 0
    assert out.split() == [
        str(tmp_path / f"run.{kind}.csv") for kind in ("per_example", "per_step")
    ]
    with GradientLog(log_path) as log:
        assert len(pandas.read_csv(tmp_path / "run.per_example.csv")) == log.num_examples
    pytest.importorskip("pyarrow")
    arguments = ("--format", "parquet", "--table", "per_step", "--out", tmp_path / "exports")
    status, out, _ = run(capsys, "export", log_path, *arguments)
    assert status == 0 and out.split() == [str(tmp_path / "exports" / "run.per_step.parquet")]
    assert "learning_rate" in pandas.read_parquet(out.strip()).columns


def test_export_parquet_without_pyarrow_is_one_clear_line(capsys, log_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    status, _, err = run(capsys, "export", log_path, "--format", "parquet")
    assert status == 1
    assert err.splitlines() == [
        "keras-gradtrack: error: to_parquet() needs pyarrow, which is not installed. Install it "
        "with `pip install pyarrow` or `pip install keras-gradtrack[parquet]`."
    ]


def test_watch_shows_rows_written_while_it_runs(tmp_path):
    path = tmp_path / "live.h5"
    writer_code = f"""
        from helpers_io import make_writer, write_steps
        with make_writer({str(path)!r}, flush_every=1) as writer:
            write_steps(writer, [4, 4])
            print("ready", flush=True)
            for line in iter(input, "stop"):
                write_steps(writer, [3])
                print("wrote", flush=True)
        """
    with child_process(writer_code) as writer:
        assert read_line(writer) == "ready"

        def write_one_step(seconds: float) -> None:
            assert seconds == 0.5
            writer.stdin.write("write\n")
            writer.stdin.flush()
            assert read_line(writer) == "wrote"

        shown = io.StringIO()
        cli.watch(path, interval=0.5, count=3, stream=shown, sleep=write_one_step)
        writer.communicate(input="stop\n", timeout=patience.seconds())
    summaries = shown.getvalue().split("refreshed every 0.5 s")
    assert len(summaries) == 4  # three summaries and what follows the last
    for summary, (steps, rows) in zip(summaries, [(2, 8), (3, 11), (4, 14)]):
        assert f"steps     {steps} tracked" in summary
        assert f"examples  {rows} rows" in summary


def test_watch_command_stops_after_count(capsys, log_path):
    status, out, _ = run(capsys, "watch", log_path, "--count", "2", "--interval", "0")
    assert status == 0 and out.count("refreshed every 0 s") == 2


def not_a_log(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "missing.h5"
    if kind == "directory":
        return tmp_path
    path = tmp_path / f"{kind}.h5"
    if kind == "text":
        path.write_text("step,loss\n0,1.0\n")
    else:
        with h5py.File(path, "w") as file:
            file["data"] = [1, 2, 3]
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "text", "foreign_hdf5"])
@pytest.mark.parametrize("command", ["summary", "top", "plot", "export", "watch", "tensorboard"])
def test_a_file_that_is_not_a_log_is_one_line_and_status_1(capsys, tmp_path, kind, command):
    path = not_a_log(tmp_path, kind)
    status, out, err = run(capsys, command, path)
    assert status == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("keras-gradtrack: error: ")
    assert str(path) in err


def test_usage_errors_exit_with_status_2(capsys):
    for argv in ([], ["frobnicate", "x.h5"], ["top", "x.h5", "-k", "0"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
    assert "expected a positive integer, received '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["watch", "x.h5", "--interval", "-1"], "a non-negative number"),
        (["watch", "x.h5", "--interval", "nan"], "a non-negative number"),
        (["top", "x.h5", "--learning-rate", "-1"], "a non-negative number"),
        (["top", "x.h5", "--learning-rate", "0"], "a positive number"),
        (["top", "x.h5", "--learning-rate", "inf"], "a non-negative number"),
    ],
)
def test_a_negative_interval_or_learning_rate_is_a_usage_error(capsys, argv, expected):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert f"expected {expected}, received '{argv[-1]}'" in capsys.readouterr().err


def test_watch_refuses_a_negative_interval(log_path):
    with pytest.raises(ValueError, match="Received: interval=-1"):
        cli.watch(log_path, interval=-1, count=1)


def test_the_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert scripts["keras-gradtrack"].value == "keras_gradtrack.cli:main"


@pytest.mark.slow
def test_the_installed_command_exits_non_zero_for_a_missing_file(tmp_path):
    script = Path(sys.executable).parent / "keras-gradtrack"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "keras_gradtrack.cli"]
    missing = tmp_path / "missing.h5"
    result = subprocess.run(
        [*command, "summary", str(missing)],
        capture_output=True,
        text=True,
        timeout=patience.seconds(2),
    )
    assert result.returncode == 1 and result.stdout == ""
    # The last line: importing TensorFlow may print its own lines to stderr first.
    assert result.stderr.strip().splitlines()[-1] == (
        f"keras-gradtrack: error: No keras_gradtrack log at '{missing}': no such file."
    )
