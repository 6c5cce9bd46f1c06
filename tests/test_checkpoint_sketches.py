"""`checkpoint_sketches`: the checks and the walk over a log's checkpoints that both
engines' target sketches share (the sketches themselves: test_attribution.py and
tests/jax_backend/test_jax_attribution.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from keras_gradtrack.attribution.checkpoint_sketches import checkpoint_sketches
from keras_gradtrack.engine.attribution_requests import sketch_widths
from keras_gradtrack.io.checkpoints import save_checkpoint


class Tracked:
    """A tracked layer as the drivers read it: its variables."""

    def __init__(self, layer: Any) -> None:
        self.variables = tuple(layer.trainable_variables)


def plan_of(model: Any) -> list[Tracked]:
    return [Tracked(layer) for layer in model.layers if layer.trainable_variables]


def model_with_kernel(value: float) -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
    model.layers[0].kernel.assign(np.full((3, 2), value, "float32"))
    return model


def kernel_sum(model: Any, plan: Any, dim: int, seed: int) -> Any:
    """A sketch function whose 'sketch' of a batch is `(len(x), 1)`: the kernel's sum at
    call time plus the examples' first inputs."""
    return lambda x, y, sample_weight: np.asarray(model.layers[0].kernel).sum() + x[:, :1]


def widths_of(model: Any, dim: int = 4) -> list[int]:
    variables = [v for tracked in plan_of(model) for v in tracked.variables]
    return [width for _, width in sketch_widths(variables, dim)]


def test_each_checkpoints_weights_are_loaded_in_step_order_then_restored(tmp_path: Path) -> None:
    checkpoints = {}
    for step, value in ((5, 2.0), (0, 1.0)):
        checkpoints[step] = tmp_path / f"step_{step}.weights.h5"
        save_checkpoint(model_with_kernel(value), checkpoints[step])
    model = model_with_kernel(7.0)
    batches = [(np.zeros((2, 3)), None, None), (np.ones((1, 3)), None, None)]
    found = checkpoint_sketches(
        model, 4, 0, widths_of(model), checkpoints, batches, plan_of, kernel_sum
    )
    assert list(found) == [0, 5]
    np.testing.assert_array_equal(found[0], [[6.0], [6.0], [7.0]])  # the batches in order
    np.testing.assert_array_equal(found[5], [[12.0], [12.0], [13.0]])
    np.testing.assert_array_equal(model.layers[0].kernel, np.full((3, 2), 7.0))


def test_a_log_without_checkpoints_is_refused() -> None:
    model = model_with_kernel(1.0)
    with pytest.raises(ValueError, match="the log has no checkpoint"):
        checkpoint_sketches(model, 4, 0, widths_of(model), {}, [], plan_of, kernel_sum)


def test_a_model_not_built_is_refused(tmp_path: Path) -> None:
    model = keras.Sequential([keras.layers.Dense(2)])
    checkpoints = {0: tmp_path / "step_0.weights.h5"}
    with pytest.raises(ValueError, match="not built yet"):
        checkpoint_sketches(model, 4, 0, [6], checkpoints, [], plan_of, kernel_sum)


def test_a_model_of_another_architecture_is_refused(tmp_path: Path) -> None:
    model = model_with_kernel(1.0)
    checkpoints = {0: tmp_path / "step_0.weights.h5"}
    with pytest.raises(ValueError, match=r"variables differ. Expected \(in the log\) widths \[7\]"):
        checkpoint_sketches(model, 4, 0, [7], checkpoints, [], plan_of, kernel_sum)
