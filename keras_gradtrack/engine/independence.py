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

Its cost is two forward passes of one batch, once per fit;
`model.check_example_independence = False` switches it off. Inference mode leaves training-only mixing (BatchNormalization in
training mode) to its own refusal. The model's non-trainable and metric variables
are restored afterwards, so nothing of the step changes: no state, no metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_gradtrack._keras_seam import flatten_layers
from keras_gradtrack.engine.losses import recording_losses

# Relative and absolute (to the largest value) tolerance of the comparison, by the
# lowest float precision among the outputs: a different batch size may change the
# order of a sum (BLAS blocking), never more than this.
TOLERANCES = {"float16": 2e-2, "bfloat16": 5e-2}
DEFAULT_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class Mixing:
    """Where the guard found examples depending on each other.

    Attributes:
        what: `"output 0"`, `"loss 0"`, ...
        difference: Largest absolute difference of the kept examples' values
            between the two batches.
        scale: Largest absolute value of the compared values.
        kept: Examples kept in both batches; `batch`: the batch size.
    """

    what: str
    difference: float
    scale: float
    kept: int
    batch: int


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
    size = leading_size(x)
    if size is None or size < 2:
        return None
    kept = size // 2
    with states_restored(model) as restore:
        full = forward(model, x, y, sample_weight)
        restore()  # both passes start from the same states (a stateful layer's)
        variant = forward(model, *(others_replaced(value, kept) for value in (x, y, sample_weight)))
    for what in full:
        if what not in variant:
            continue
        # A loss may be normalized by a count over the batch (the unmasked positions of
        # a masked sequence loss): one constant for all its examples, no mixing.
        mixing = compare(
            what,
            variant[what][:kept],
            full[what][:kept],
            size,
            up_to_scale=what.startswith("loss"),
        )
        if mixing is not None:
            return mixing
    return None


def forward(model: Any, x: Any, y: Any, sample_weight: Any) -> dict[str, np.ndarray]:
    """`{what: (B, ...) values}`: the outputs and, with a compiled loss and targets,
    the per-example sums of the weighted loss values Keras reduces."""
    with recording_losses() as recorder:
        y_pred = model(x, training=False)
        if y is not None and getattr(model, "compiled_loss", None) is not None:
            model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    found: dict[str, np.ndarray] = {}
    for index, output in enumerate(tree.flatten(y_pred)):
        if tf.is_tensor(output) and output.shape.rank and output.dtype.is_floating:
            found[f"output {index}"] = np.asarray(output)
    for index, record in enumerate(recorder.records):
        values = tf.cast(record.values, tf.float32)
        if values.shape.rank:
            axes = list(range(1, values.shape.rank))
            found[f"loss {index}"] = np.asarray(
                tf.reduce_sum(values, axis=axes) if axes else values
            )
    return found


def compare(
    what: str, variant: np.ndarray, in_batch: np.ndarray, size: int, up_to_scale: bool = False
) -> Mixing | None:
    """`Mixing` unless `variant` equals `in_batch` (times one positive factor, with
    `up_to_scale`) within the tolerance of their precision."""
    if variant.shape != in_batch.shape:
        # Not a per-example value (an output without a batch axis).
        return None
    tolerance = TOLERANCES.get(str(variant.dtype), DEFAULT_TOLERANCE)
    variant64, batch64 = variant.astype(np.float64), in_batch.astype(np.float64)
    if up_to_scale:
        both = np.isfinite(variant64) & np.isfinite(batch64)
        norm = float(np.sum(batch64[both] ** 2))
        factor = float(np.sum(variant64[both] * batch64[both])) / norm if norm else 1.0
        if factor > 0:
            batch64 = np.where(both, batch64 * factor, batch64)
    finite = np.isfinite(variant64) & np.isfinite(batch64)
    if not finite.any():
        return None
    # A non-finite value (a NaN loss of a diverged model) is compared by where it is.
    scale = float(np.abs(batch64[finite]).max())
    difference = np.abs(variant64[finite] - batch64[finite])
    allowed = tolerance * (np.abs(batch64[finite]) + scale + np.finfo(np.float32).tiny)
    if np.all(difference <= allowed) and np.array_equal(
        np.isfinite(variant64), np.isfinite(batch64)
    ):
        return None
    return Mixing(what, float(difference.max()), scale, len(variant), size)


def mixing_error(model: Any, mixing: Mixing) -> ValueError:
    """The refusal for a failed guard: the symptom and the ways out."""
    return ValueError(
        f"Model {model.name!r} mixes the examples of a batch: in inference mode, "
        f"{mixing.what} of the first {mixing.kept} examples of a batch of {mixing.batch} "
        "changes when the other examples are replaced (largest difference "
        f"{mixing.difference:.3g}, values up to {mixing.scale:.3g}). Some operation lets "
        "one example's values depend on the others (a `tensordot` or reduction over "
        "the batch axis, a statistic of the batch), so example i's loss is not its own "
        "and no per-example gradient is defined. Ways out: make the operation act on "
        "each example alone (for a dot product of two (batch, dim) vectors, "
        "`ops.sum(u * v, axis=-1, keepdims=True)` rather than `ops.tensordot(u, v, 2)`, "
        "which sums over the batch too); for a normalization over the batch, see "
        "BatchNormalization's options (`model.track_batch_normalization = True`, or "
        "`kgt.convert_to_group_normalization(model)`). This check costs two forward "
        "passes of one batch, once per fit; `model.check_example_independence = False` "
        "switches it off."
    )


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


def leading_size(x: Any) -> int | None:
    sizes = {
        int(value.shape[0])
        for value in tree.flatten(x)
        if hasattr(value, "shape") and len(value.shape) and value.shape[0] is not None
    }
    return sizes.pop() if len(sizes) == 1 else None


def others_replaced(data: Any, kept: int) -> Any:
    """`data` (any structure; None stays None) with its rows from `kept` on replaced by
    its first rows in reverse order (the batch size stays)."""
    if data is None:
        return None

    def replaced(value: Any) -> Any:
        if value is None:
            return None
        value = tf.convert_to_tensor(value) if not tf.is_tensor(value) else value
        size = tf.shape(value)[0]
        return tf.concat([value[:kept], tf.reverse(value[: size - kept], axis=[0])], axis=0)

    return tree.map_structure(replaced, data)


def rows(data: Any, count: int) -> Any:
    """The first `count` examples of `data` (any structure; None stays None)."""
    if data is None:
        return None
    return tree.map_structure(lambda value: None if value is None else value[:count], data)


@dataclasses.dataclass
class IndependenceGuard:
    """One fit's guard: whether it runs, and the batch put aside for it.

    Attributes:
        wanted: Whether the fit checks (the setting is on and a gradient callback
            will subscribe).
        batch: The batch put aside, until the first tracked step checks it.
    """

    wanted: bool
    batch: Any = None


def subscribes_to_gradients(callbacks: Any) -> bool:
    """Whether any of `fit`'s callbacks asks for tracked steps (`subscribes_to_gradients`)."""
    if callbacks is None:
        return False
    callbacks = getattr(callbacks, "callbacks", callbacks)  # a keras CallbackList
    return any(getattr(callback, "subscribes_to_gradients", False) for callback in callbacks)


def first_batch(iterator: Any) -> Any:
    """The first batch of `fit`'s epoch iterator (which Keras resets afterwards)."""
    if iterator is None:
        return None
    for _, _, data_iterator in iterator:
        if isinstance(data_iterator, (list, tuple)):
            return data_iterator[0]
        return next(data_iterator)
    return None
