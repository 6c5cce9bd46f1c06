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


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        module = importlib.import_module(name)
    finally:
        for loaded in SCRIPTS:
            sys.modules.pop(loaded, None)
    assert hasattr(module, "main") or name in ("zoo", "report", "baselines")
