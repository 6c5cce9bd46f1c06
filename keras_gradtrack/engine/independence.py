"""The example-independence guard: does each example's loss depend on its batch?

A per-example gradient `g_i = d l_i / d theta` exists only when example i's loss
depends on example i's data alone. An operation that mixes the examples of a
batch (a `tensordot` or a reduction over the batch axis, a batch statistic)
breaks that, and no rule or tap can tell: the statistics would be numbers that
match no per-example gradient. So before the first tracked step of a fit (and in
`kgt.check` given a batch), the model runs in inference mode on a batch and on
the same batch with its second half replaced by other examples (the first half's,
reversed: the batch size stays, as stateful layers need), and the outputs and
per-example losses of the first half must not change, within float tolerance.

Its cost is two forward passes of one batch, once per model, compiled loss and batch
signature (a later fit of the same kind skips it);
`model.check_example_independence = False` switches it off. Inference mode leaves training-only mixing (BatchNormalization in
training mode) to its own refusal. The model's non-trainable and metric variables
are restored afterwards, so nothing of the step changes: no state, no metric.
The comparison, the refusal and when a fit checks are backend-neutral
(`engine/example_independence.py`, which the JAX engine's guard uses too); the
forward passes here are TensorFlow's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gradtrack._keras_seam import compute_loss, flatten_layers
from keras_gradtrack.engine.example_independence import (
    IndependenceGuard,
    Mixing,
    compared_values,
    find_mixing,
    first_batch,
    mixing_error,
    rows,
    subscribes_to_gradients,
)
from keras_gradtrack.engine.losses import recording_losses

__all__ = [
    "IndependenceGuard",
    "find_example_mixing",
    "first_batch",
    "forward",
    "mixing_error",
    "rows",
    "state_variables",
    "states_restored",
    "subscribes_to_gradients",
]


def find_example_mixing(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> Mixing | None:
    """Runs the guard on one batch: `Mixing` where it fails, None where it holds
    (or where a batch of one example leaves nothing to compare).

    Args:
        model: A built Keras model.
        x: The batch's inputs (without example ids).
        y: Its targets; with a compiled loss, the per-example losses are compared too.
        sample_weight: Its sample weights, if any.
    """

    def passes(batch: tuple[Any, ...], variant: tuple[Any, ...]) -> Any:
        with states_restored(model) as restore:
            full = forward(model, *batch)
            restore()  # both passes start from the same states (a stateful layer's)
            return full, forward(model, *variant)

    return find_mixing(x, y, sample_weight, passes)


def forward(model: Any, x: Any, y: Any, sample_weight: Any) -> dict[str, np.ndarray]:
    """`{what: (B, ...) values}`: the outputs and, with a compiled loss and targets,
    the per-example sums of the weighted loss values Keras reduces."""
    with recording_losses() as recorder:
        y_pred = model(x, training=False)
        if y is not None and getattr(model, "compiled_loss", None) is not None:
            compute_loss(model, x, y, y_pred, sample_weight, training=False)
    found = compared_values(y_pred, recorder.records)
    return {name: keras.ops.convert_to_numpy(value) for name, value in found.items()}


def state_variables(model: Any) -> list[Any]:
    """The variables a forward pass and a loss may change (states, statistics, metrics)."""
    variables = list(model.non_trainable_variables) + list(model.metrics_variables)
    for layer in flatten_layers(model):
        # A stateful recurrent layer keeps its states as variables Keras does not track.
        states = getattr(layer, "states", None) if getattr(layer, "stateful", False) else None
        variables.extend(s for s in tree.flatten(states or []) if isinstance(s, keras.Variable))
    unique = {id(v): v for v in variables}
    return list(unique.values())


@contextlib.contextmanager
def states_restored(model: Any) -> Iterator[Callable[[], None]]:
    """The model's `state_variables` as they were, when the block ends however it ends.

    Yields:
        A function that restores them at once (inside the block too).
    """
    saved = [(v, v.numpy()) for v in state_variables(model)]

    def restore() -> None:
        for variable, value in saved:
            variable.assign(value)

    try:
        yield restore
    finally:
        restore()
