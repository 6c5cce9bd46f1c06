"""`make demo` runs `python -m keras_gradtrack.demo`; a short run must work end to end."""

from pathlib import Path

import pytest

from keras_gradtrack import demo


def test_demo_trains_logs_and_summarizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.main(["--out", str(tmp_path), "--epochs", "2"])
    printed = capsys.readouterr().out
    assert (tmp_path / "digits_run.h5").exists()
    assert "rule:dense" in printed
    assert "top 10% by self-influence" in printed
