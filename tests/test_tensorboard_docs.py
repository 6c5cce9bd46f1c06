"""The snippet of docs/tensorboard.md that reads event files back runs and reads the
log's values (TensorBoard stores scalars and histograms as tensors)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_analysis import write_log

import keras_gradtrack as kgt
from keras_gradtrack.analysis import GradientLog

pytest.importorskip("tensorboard")

DOC = Path(__file__).resolve().parent.parent / "docs" / "tensorboard.md"


def reading_snippet() -> str:
    section = DOC.read_text().split("## Reading the event files back", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_snippet_reads_back_the_scalars_and_histograms(tmp_path: Path) -> None:
    log = write_log(tmp_path / "run.h5")
    logdir = tmp_path / "tb" / "run"
    kgt.write_tensorboard(log.path, logdir)
    namespace: dict = {}
    exec(reading_snippet().replace('"tb/run"', repr(str(logdir))), namespace)

    events = namespace["events"]
    assert events.Tags()["scalars"] == [] and events.Tags()["histograms"] == []
    assert namespace["kind"] == "histograms"
    with GradientLog(log.path) as read:
        steps = read.per_step("step")
        np.testing.assert_allclose(
            [namespace["batch_grad_norm"][s] for s in steps],
            read.per_step("batch_grad_norm"),
            rtol=1e-6,
        )
        example_steps, grad_norm = read.per_example("step"), read.per_example("grad_norm")
    histograms = namespace["histograms"]
    assert sorted(histograms) == steps.tolist()
    for step, histogram in histograms.items():
        values = grad_norm[example_steps == step]
        assert histogram[:, 2].sum() == len(values)
        assert histogram[0, 0] == pytest.approx(values.min(), rel=1e-6)
        assert histogram[-1, 1] == pytest.approx(values.max(), rel=1e-6)
