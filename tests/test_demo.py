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
    # The epoch lines show the step statistics (GradientStatisticsToLogs) ...
    assert "gradient_diversity: " in printed
    # ... and the run is written for TensorBoard, with the command that opens it.
    board = tmp_path / "tensorboard"
    assert f"tensorboard --logdir {board}" in printed
    assert list((board / "gradients").glob("events.out.tfevents.*"))
    assert list((board / "keras" / "train").glob("events.out.tfevents.*"))
