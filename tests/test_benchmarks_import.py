"""Every benchmark script imports: they share helpers (`zoo.py`, `report.py`,
`baselines.py`), and a helper renamed in one must not break another unnoticed
(the scripts run on demand, not in the suite)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
# The helpers the scripts share; every other module is a script with a `main`.
HELPERS = {"zoo", "report", "baselines"}


def test_the_helpers_are_there() -> None:
    assert set(SCRIPTS) >= HELPERS, sorted(HELPERS - set(SCRIPTS))


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        module = importlib.import_module(name)
    finally:
        for loaded in SCRIPTS:
            sys.modules.pop(loaded, None)
    if name in HELPERS:
        assert not hasattr(module, "main"), f"{name} has a main: a script, not a helper"
    else:
        assert callable(getattr(module, "main", None)), f"{name} has no main()"
