"""`steps_per_execution > 1`: several steps per compiled call, every step logged as alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
# 70 examples in batches of 8: 9 steps an epoch, the last of 6 examples; with 4 steps
# per call, calls of 4, 4 and 1 step.
X = rng.normal(size=(70, 6)).astype("float32")
Y = rng.integers(0, 3, 70)


def model(steps: int, jit_compile: bool = False) -> Any:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    tracked = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))
    tracked.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps,
        jit_compile=jit_compile,
    )
    return tracked


def datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as file:
        file.visititems(
            lambda name, item: (
                found.update({name: item[()]}) if isinstance(item, h5py.Dataset) else None
            )
        )
    return found


def fit_and_log(path: Path, steps: int, **logger: Any) -> tuple[Any, Any, dict[str, list[float]]]:
    tracked = model(steps, jit_compile=logger.pop("jit_compile", False))
    to_logs = kgt.GradientStatisticsToLogs(prefix="grad/")
    history = tracked.fit(
        X,
        Y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[to_logs, kgt.HDF5GradientLogger(path, **logger)],
    )
    return tracked, datasets(path), history.history


@pytest.mark.parametrize(
    "logger",
    [{}, {"every_n_steps": 3}, {"jit_compile": True}],
    ids=["every_step", "every_third_step", "jit_compile"],
)
def test_rows_weights_and_logs_equal_those_of_one_step_per_call(
    tmp_path: Path, logger: dict[str, Any]
) -> None:
    one, one_rows, one_history = fit_and_log(tmp_path / "one.h5", 1, **dict(logger))
    four, four_rows, four_history = fit_and_log(tmp_path / "four.h5", 4, **dict(logger))
    assert one_rows.keys() == four_rows.keys()
    every = logger.get("every_n_steps", 1)
    # 18 steps, each logged with its own number.
    np.testing.assert_array_equal(four_rows["per_step/step"], np.arange(0, 18, every))
    assert len(four_rows["per_example/grad_norm"]) == sum(
        ([8] * 8 + [6])[step % 9] for step in range(0, 18, every)
    )
    for name, rows in one_rows.items():
        np.testing.assert_allclose(four_rows[name], rows, rtol=1e-6, atol=1e-7, err_msg=name)
    for before, after in zip(one.get_weights(), four.get_weights()):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)
    # The epoch's mean in fit's logs counts every step, not only each call's last.
    assert one_history.keys() == four_history.keys()
    for key, values in one_history.items():
        np.testing.assert_allclose(four_history[key], values, rtol=1e-6, err_msg=key)


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
