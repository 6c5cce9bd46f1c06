"""Tracked equals plain: one tracked step trains exactly as one plain Keras step.

From the same state (weights, optimizer slots, random generators, metrics), one
step of the real tracked `fit` (an `HDF5GradientLogger` attached, so every check
and tap runs) and one step of plain Keras' own `train_step` (the Keras trainer's,
or the model's own `train_step` with `tracked_gradient` being `tape.gradient`)
on the same batch must give the optimizer the same gradient, leave the same
variables (trainable and not) and report the same metrics, float32 rounding
aside. The gradients are read where the optimizer receives them (`apply`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

import keras_gradtrack as kgt

# Relative to the largest entry of the compared tensor: float32 rounding of sums
# taken in another order (per-example gradients summed, say).
RTOL = 1e-4
ATOL = 1e-5


def assert_tracked_step_equals_plain(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> None:
    """Asserts the invariant for one batch (the whole of `x`, `y`, `sample_weight`)."""
    optimizer = model.optimizer
    if not model.built:
        model(x)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    state = unique(
        [*model.variables, *recurrent_states(model), *optimizer.variables, *model.metrics_variables]
    )
    saved = [v.numpy() for v in state]

    plain_gradients, plain_metrics = plain_step(model, x, y, sample_weight)
    plain_state = [v.numpy() for v in state]
    for variable, value in zip(state, saved):
        variable.assign(value)
    tracked_gradients, tracked_metrics = tracked_step(model, x, y, sample_weight)
    tracked_state = [v.numpy() for v in state]

    # Rounding scales with the largest values of the step, not with each entry.
    gradient_scale = max(float(np.abs(g).max()) for g in plain_gradients if g.size)
    for variable, tracked, plain in zip(
        model.trainable_variables, tracked_gradients, plain_gradients
    ):
        assert_close(tracked, plain, f"gradient of {variable.path}", gradient_scale)
    gradients = {
        id(variable): (tracked, plain)
        for variable, tracked, plain in zip(
            model.trainable_variables, tracked_gradients, plain_gradients
        )
    }
    # The optimizer's slots follow from the gradients it received (compared above);
    # its step count is compared.
    slots = {id(v) for v in optimizer.variables if v is not optimizer.iterations}
    for variable, before, tracked, plain in zip(state, saved, tracked_state, plain_state):
        if id(variable) in slots:
            continue
        tracked_change, plain_change = tracked - before, plain - before
        if id(variable) in gradients:
            assert_update_close(
                tracked_change, plain_change, *gradients[id(variable)], variable, plain
            )
        else:
            assert_close(tracked_change, plain_change, f"change of {variable.path}")
    assert tracked_metrics.keys() == plain_metrics.keys(), (tracked_metrics, plain_metrics)
    for name, plain in plain_metrics.items():
        assert_close(tracked_metrics[name], plain, f"metric {name}")


def plain_step(model: Any, x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], dict]:
    """One step of Keras' own train step (or the model's own), compiled as `fit` would."""
    own = type(model).train_step.__qualname__ != "GradientTrackingMixin.train_step"
    step = type(model).train_step if own else keras.Model.train_step
    data = tree.map_structure(
        lambda value: None if value is None else tf.convert_to_tensor(value),
        keras.utils.pack_x_y_sample_weight(x, y, sample_weight),
    )
    model.reset_metrics()
    with captured_gradients(model) as captured:
        function = tf.function(
            lambda data: step(model, data), jit_compile=bool(model.jit_compile), autograph=False
        )
        logs = function(data)
    return captured.values(), flattened(logs)


def flattened(logs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The logs as `fit` reports them: a metric container's dict of results merged in."""
    found: dict[str, np.ndarray] = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            found.update(flattened(value))
        else:
            found[name] = np.asarray(value)
    return found


def tracked_step(model: Any, x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], dict]:
    """One step of the tracked `fit`, with a logger attached."""
    model.train_function = None  # traced anew, with the capture in place
    with tempfile.TemporaryDirectory() as directory, captured_gradients(model) as captured:
        history = model.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=len(tree.flatten(x)[0]),
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[kgt.HDF5GradientLogger(Path(directory) / "run.h5")],
        )
        with kgt.GradientLog(Path(directory) / "run.h5") as log:
            assert len(log.per_step("batch_size")) == 1, "the step was not tracked"
    model.train_function = None
    metrics = {name: np.asarray(values[-1]) for name, values in history.history.items()}
    return captured.values(), metrics


class Captured:
    """Holds, per trainable variable, the last gradient the optimizer received."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.slots = [
            tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False)
            for v in model.trainable_variables
        ]
        self.position = {id(v): i for i, v in enumerate(model.trainable_variables)}

    def record(self, gradients: Any, variables: Any) -> None:
        for gradient, variable in zip(gradients, variables):
            index = self.position.get(id(variable))
            if index is not None and gradient is not None:
                self.slots[index].assign(tf.cast(tf.convert_to_tensor(gradient), tf.float32))

    def values(self) -> list[np.ndarray]:
        return [slot.numpy() for slot in self.slots]


class captured_gradients:
    """The optimizer's `apply` records the gradients it receives, for the block."""

    def __init__(self, model: Any) -> None:
        self.optimizer = model.optimizer
        self.captured = Captured(model)

    def __enter__(self) -> Captured:
        original = self.optimizer.apply

        def apply(gradients: Any, variables: Any = None) -> Any:
            gradients = list(gradients)
            variables = list(variables) if variables is not None else variables
            self.captured.record(gradients, variables)
            return original(gradients, variables)

        self.optimizer.apply = apply
        return self.captured

    def __exit__(self, *exc_info: Any) -> None:
        del self.optimizer.apply


def assert_update_close(
    tracked_change: np.ndarray,
    plain_change: np.ndarray,
    tracked_gradient: np.ndarray,
    plain_gradient: np.ndarray,
    variable: Any,
    after: Any = None,
) -> None:
    """The weights' changes agree as closely as the gradients they came from.

    An update is at most as sensitive to its gradient as SGD, relatively (Adam's
    `g / (|g| + eps)` less so): each entry may differ by its gradient's relative
    difference (rounding noise where the exact gradient is 0, such as attention's
    key bias) besides `RTOL`, and by one float32 spacing of the weight it is stored
    in (`after`: two gradients a rounding apart give weights one spacing apart when
    the weight is large against its change).
    """
    plain_change = np.asarray(plain_change, np.float64)
    tracked_change = np.asarray(tracked_change, np.float64)
    if not plain_change.size:
        return
    gradient = np.asarray(plain_gradient, np.float64).reshape(plain_change.shape)
    relative = np.abs(np.asarray(tracked_gradient, np.float64).reshape(gradient.shape) - gradient)
    relative /= np.abs(gradient) + np.finfo(np.float32).tiny
    size = np.maximum(np.abs(plain_change), np.abs(tracked_change))
    allowed = (RTOL + 2 * relative) * size + ATOL * np.abs(plain_change).max()
    if after is not None:
        stored = np.abs(np.asarray(after, np.float32)).reshape(plain_change.shape)
        allowed = allowed + np.spacing(stored).astype(np.float64) * (relative > 0)
    excess = np.abs(tracked_change - plain_change) - allowed
    assert np.all(excess <= 1e-12), (
        f"change of {variable.path}: differs by up to "
        f"{np.abs(tracked_change - plain_change).max():.3g} where "
        f"{allowed.ravel()[np.argmax(excess)]:.3g} is allowed"
    )


def assert_close(actual: Any, expected: Any, what: str, scale: float | None = None) -> None:
    """`actual == expected` up to `RTOL` of each entry plus `ATOL` of `scale` (default:
    the largest entry of `expected`)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    if not expected.size:
        return
    if scale is None:
        scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale + 1e-12, err_msg=what)


def recurrent_states(model: Any) -> list[Any]:
    """The states of stateful recurrent layers (variables Keras does not track)."""
    found = []
    for layer in model._flatten_layers():
        if getattr(layer, "stateful", False):
            found.extend(
                s for s in tree.flatten(layer.states or []) if isinstance(s, keras.Variable)
            )
    return found


def unique(variables: list[Any]) -> list[Any]:
    return list({id(v): v for v in variables}.values())
