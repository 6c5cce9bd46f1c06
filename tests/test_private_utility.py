"""`benchmarks/private_utility.py` reads its drivers' JSON lines and prints the table
(canned lines: the drivers need the peers' own virtualenvs, which the suite has not)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("private_utility")
    sys.modules.pop("private_utility", None)


def line(tool: str, seed: int, accuracy: float, seconds: float, **extra) -> str:
    row = {"tool": tool, "seed": seed, "accuracy": accuracy, "epsilon": 7.19, "steps": 660,
           "seconds": seconds, "epochs": 30, **extra}  # fmt: skip
    return json.dumps(row)


def test_the_runner_reads_the_json_lines_among_the_chatter(runner) -> None:
    output = [
        "2026-12-05 13:18:31 I tensorflow/core/platform/cpu_feature_guard.cc:182] ...",
        line("Opacus", 0, 0.95, 3.0),
        "{not json}",
        '{"tool": "Opacus"}',
        line("Opacus", 1, 0.97, 3.6),
    ]
    rows = runner.parse(output)
    assert [(row["tool"], row["seed"]) for row in rows] == [("Opacus", 0), ("Opacus", 1)]


def test_the_table_has_a_line_per_tool_with_mean_and_std(runner) -> None:
    extra = {"accountant": "RDP (opacus)", "epsilon_other": 6.55, "other_accountant": "PRV"}
    rows = runner.parse(
        [
            line("Opacus", 0, 0.95, 3.0, sampling="Poisson", **extra),
            line("Opacus", 1, 0.97, 3.6, sampling="Poisson", **extra),
            line("TF Privacy", 0, 0.96, 6.0, sampling="fixed"),
        ]
    )
    lines = runner.table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| Opacus | Poisson | 0.960 ± 0.014 | 2 | 7.19 (RDP) | 6.55 (PRV) | 660 | 0.110 ± 0.014 |"
    )
    assert lines[3] == "| TF Privacy | fixed | 0.960 | 1 | 7.19 | - | 660 | 0.200 |"


def test_a_tool_without_its_interpreter_is_skipped(runner, monkeypatch, capsys, tmp_path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setattr(
        sys, "argv", ["private_utility.py", "--tools", "opacus", "--torch-python", str(missing)]
    )
    runner.main()
    assert f"# opacus: skipped, no interpreter at {missing}" in capsys.readouterr().out


def test_each_keras_gradtrack_tool_runs_its_driver_on_its_backend(runner, monkeypatch, tmp_path):
    """`keras_gradtrack` and `keras_gradtrack_jax` run the same driver in the project's
    interpreter with KERAS_BACKEND tensorflow and jax (a stub interpreter echoes both)."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        'echo "{\\"tool\\": \\"$KERAS_BACKEND\\", \\"seed\\": 0, \\"accuracy\\": 1.0, '
        '\\"epsilon\\": 1.0, \\"steps\\": 1, \\"seconds\\": 1.0, \\"driver\\": \\"$1\\"}"\n'
    )
    stub.chmod(0o755)
    out = tmp_path / "rows.jsonl"
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # not inherited by either tool
    tools = "keras_gradtrack,keras_gradtrack_jax"
    argv = ["private_utility.py", "--tools", tools, "--kgt-python", str(stub), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--seeds", "0"])
    runner.main()
    rows = [json.loads(row) for row in out.read_text().splitlines()]
    assert [row["tool"] for row in rows] == ["tensorflow", "jax"]
    assert {Path(row["driver"]).name for row in rows} == {"kgt_digits.py"}
