"""`steps_per_execution > 1` on JAX: every step's rows logged, as with one step per call.

Keras' JAX trainer runs a call's steps one after another, each its own jitted step;
the tracked train function does the same, each step tracked or not as the loggers
ask, so the log equals that of one step per call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
# 70 examples in batches of 8: 9 steps an epoch, the last of 6 examples.
X = rng.normal(size=(70, 6)).astype("float32")
Y = rng.integers(0, 3, 70)


def model(steps: int) -> Any:
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
    tracked = model(steps)
    history = tracked.fit(
        X,
        Y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path, **logger)],
    )
    return tracked, datasets(path), history.history


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("every_n_steps", [1, 3])
def test_rows_weights_and_logs_equal_those_of_one_step_per_call(
    tmp_path: Path, steps: int, every_n_steps: int
) -> None:
    one, one_rows, one_history = fit_and_log(tmp_path / "one.h5", 1, every_n_steps=every_n_steps)
    many, many_rows, many_history = fit_and_log(
        tmp_path / "many.h5", steps, every_n_steps=every_n_steps
    )
    assert one_rows.keys() == many_rows.keys()
    # 18 steps, each logged with its own number.
    np.testing.assert_array_equal(many_rows["per_step/step"], np.arange(0, 18, every_n_steps))
    assert len(many_rows["per_example/grad_norm"]) == sum(
        ([8] * 8 + [6])[step % 9] for step in range(0, 18, every_n_steps)
    )
    for name, rows in one_rows.items():
        np.testing.assert_allclose(many_rows[name], rows, rtol=1e-6, atol=1e-7, err_msg=name)
    for before, after in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)
    assert one_history.keys() == many_history.keys()
    for key, values in one_history.items():
        np.testing.assert_allclose(many_history[key], values, rtol=1e-6, err_msg=key)
