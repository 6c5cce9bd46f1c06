"""The suite's waits scale with the machine: ten times slower, ten times longer."""

import patience
import pytest


def test_a_ten_times_slower_machine_waits_ten_times_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quiet = patience.QUIET_IMPORT_SECONDS
    monkeypatch.setattr(patience, "_import_seconds", quiet)
    limit = patience.seconds(imports=6)
    monkeypatch.setattr(patience, "_import_seconds", 10 * quiet)
    assert patience.seconds(imports=6) == pytest.approx(10 * limit)
    assert patience.slowdown() == pytest.approx(10)


def test_a_wait_is_at_least_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patience, "_import_seconds", 0.5)
    assert patience.seconds(imports=0.1) == patience.FLOOR_SECONDS
    assert patience.slowdown() == 1


def test_this_process_measured_its_imports() -> None:
    assert patience.import_seconds() >= patience.QUIET_IMPORT_SECONDS
