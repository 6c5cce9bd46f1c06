"""`steps_per_execution > 1`, on either backend (no backend imports here): every step's
rows, the weights and fit's logs equal those of one step per call.
tests/test_steps_per_execution.py runs it on TensorFlow,
tests/jax_backend/test_jax_steps_per_execution.py on JAX."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
# 70 examples in batches of 8: 9 steps an epoch, the last of 6 examples; with 4 steps
# per call, calls of 4, 4 and 1 step.
X = rng.normal(size=(70, 6)).astype("float32")
Y = rng.integers(0, 3, 70)


def model(steps: int, **compile_options: Any) -> Any:
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
        **compile_options,
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


def fit_and_log(
    path: Path,
    steps: int,
    callbacks: Callable[[], list[Any]],
    compile_options: dict[str, Any],
    **logger: Any,
) -> tuple[Any, Any, dict[str, list[float]]]:
    tracked = model(steps, **compile_options)
    history = tracked.fit(
        X,
        Y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks(), kgt.HDF5GradientLogger(path, **logger)],
    )
    return tracked, datasets(path), history.history


def assert_equals_one_step_per_call(
    directory: Path,
    steps: int,
    callbacks: Callable[[], list[Any]] = list,
    compile_options: dict[str, Any] | None = None,
    **logger: Any,
) -> None:
    """Two epochs at `steps` steps per call, with the callbacks that `callbacks()`
    returns and an `HDF5GradientLogger(**logger)`, equal two epochs at one."""
    compile_options = compile_options or {}
    one, one_rows, one_history = fit_and_log(
        directory / "one.h5", 1, callbacks, compile_options, **logger
    )
    many, many_rows, many_history = fit_and_log(
        directory / "many.h5", steps, callbacks, compile_options, **logger
    )
    assert one_rows.keys() == many_rows.keys()
    every = logger.get("every_n_steps", 1)
    # 18 steps, each logged with its own number.
    np.testing.assert_array_equal(many_rows["per_step/step"], np.arange(0, 18, every))
    assert len(many_rows["per_example/grad_norm"]) == sum(
        ([8] * 8 + [6])[step % 9] for step in range(0, 18, every)
    )
    for name, rows in one_rows.items():
        np.testing.assert_allclose(many_rows[name], rows, rtol=1e-6, atol=1e-7, err_msg=name)
    for before, after in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-7)
    # The epoch's mean in fit's logs counts every step, not only each call's last.
    assert one_history.keys() == many_history.keys()
    for key, values in one_history.items():
        np.testing.assert_allclose(many_history[key], values, rtol=1e-6, err_msg=key)
