"""`steps_per_execution > 1`: several steps per compiled call, every step logged as alone
(tests/steps_per_execution.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import steps_per_execution
from steps_per_execution import X, Y, assert_equals_one_step_per_call, datasets

import keras_gradtrack as kgt


def model(steps: int) -> Any:
    return steps_per_execution.model(steps, jit_compile=False)


@pytest.mark.parametrize(
    "logger",
    [{}, {"every_n_steps": 3}, {"jit_compile": True}],
    ids=["every_step", "every_third_step", "jit_compile"],
)
def test_rows_weights_and_logs_equal_those_of_one_step_per_call(
    tmp_path: Path, logger: dict[str, Any]
) -> None:
    logger = dict(logger)
    assert_equals_one_step_per_call(
        tmp_path,
        4,
        lambda: [kgt.GradientStatisticsToLogs(prefix="grad/")],
        {"jit_compile": logger.pop("jit_compile", False)},
        **logger,
    )


def test_check_finds_nothing_to_refuse(tmp_path: Path) -> None:
    assert kgt.check(model(4)).refusals == []


def test_checkpoints_must_fall_on_a_call_boundary(tmp_path: Path) -> None:
    tracked = model(4)
    before = tracked.get_weights()
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", checkpoint_every=6)
    with pytest.raises(ValueError, match=r"multiple of it\. Received: checkpoint_every=6"):
        tracked.fit(X, Y, batch_size=8, verbose=0, callbacks=[logger])
    for old, new in zip(before, tracked.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_checkpoints_on_call_boundaries_hold_the_weights_one_step_per_call_has(
    tmp_path: Path,
) -> None:
    for steps in (1, 4):
        logger = kgt.HDF5GradientLogger(tmp_path / f"{steps}.h5", checkpoint_every=4)
        model(steps).fit(X, Y, batch_size=8, shuffle=False, verbose=0, callbacks=[logger])
    names = sorted(path.name for path in (tmp_path / "4.checkpoints").iterdir())
    assert names == [f"step_{step:09d}.weights.h5" for step in (0, 4, 8)]
    for name in names:
        saved = [datasets(tmp_path / f"{steps}.checkpoints" / name) for steps in (1, 4)]
        assert saved[0].keys() == saved[1].keys() and saved[0]
        for key, weights in saved[0].items():
            np.testing.assert_allclose(saved[1][key], weights, rtol=1e-6, atol=1e-7)


def test_output_gradient_logger_is_refused(tmp_path: Path) -> None:
    logger = kgt.OutputGradientLogger(tmp_path / "out.h5", X[:4])
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model(4).fit(X, Y, batch_size=8, verbose=0, callbacks=[logger])


def test_private_training_is_refused() -> None:
    tracked = model(1)
    tracked.make_private(l2_norm_clip=1.0, noise_multiplier=0.0)
    tracked.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=2,
    )
    assert any("steps_per_execution=1" in r for r in kgt.check(tracked).refusals)
    before = tracked.get_weights()
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        tracked.fit(X, Y, batch_size=8, verbose=0)
    for old, new in zip(before, tracked.get_weights()):
        np.testing.assert_array_equal(old, new)
