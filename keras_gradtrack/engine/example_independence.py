"""The example-independence guard's backend-neutral part: comparing, refusing, when to run.

The guard (`engine/independence.py` on TensorFlow, `backends/jax/independence.py`
on JAX) runs the model in inference mode on a batch and on the same batch with
its second half replaced by other examples; this module makes that variant and
compares the first half's values of the two passes (`find_mixing`,
`first_mixing`), words the refusal (`mixing_error`) and says whether a fit runs
the guard (`IndependenceGuard`, `subscribes_to_gradients`). It imports no
TensorFlow, so the JAX engine uses it where TensorFlow is not installed.

Example:

```python
mixing = first_mixing(full, variant, kept=4, size=8)   # {what: (B, ...) values} each
if mixing is not None:
    raise mixing_error(model, mixing)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gradtrack._keras_seam import compiled_loss
from keras_gradtrack.engine import reductions

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


# The batch `(x, y, sample_weight)` and its variant -> each pass's `{what: (B, ...) values}`.
Passes = Callable[
    [tuple[Any, Any, Any], tuple[Any, Any, Any]],
    tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]],
]


def find_mixing(x: Any, y: Any, sample_weight: Any, passes: Passes) -> Mixing | None:
    """The guard on one batch, by the backend's two inference passes: `Mixing` where the
    first half's values change when the other examples are replaced by the first
    half's in reverse order (`others_replaced`), None where they do not (or where a
    batch of one example leaves nothing to compare).

    Args:
        x: The batch's inputs (without example ids).
        y: Its targets, or None.
        sample_weight: Its sample weights, or None.
        passes: `(batch, variant) -> (full, changed)`: the forward passes on the
            batch and on its variant, each an `(x, y, sample_weight)`, giving
            `{what: (B, ...) values}` each (`"output 0"`, `"loss 0"`, ...).

    Example:

    ```python
    mixing = find_mixing(x, y, None, lambda batch, variant: (run(*batch), run(*variant)))
    ```
    """
    size = leading_size(x)
    if size is None or size < 2:
        return None
    kept = size // 2
    variant = tuple(others_replaced(value, kept) for value in (x, y, sample_weight))
    full, changed = passes((x, y, sample_weight), variant)
    return first_mixing(full, changed, kept, size)


def first_mixing(
    full: Mapping[str, np.ndarray], variant: Mapping[str, np.ndarray], kept: int, size: int
) -> Mixing | None:
    """The first value (`"output 0"`, `"loss 0"`, ...) whose kept rows differ between
    the pass on the batch (`full`) and the pass with the other rows replaced
    (`variant`); None when none does."""
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


def compared_values(outputs: Any, records: Any) -> dict[str, Any]:
    """`{what: (B, ...) values}` of one inference pass: the float outputs of rank 1 or
    more, and each recorded loss reduction's per-example sums (`records`: what
    `reductions.recording_losses` recorded; a scalar reduction has no rows to compare).
    Backend tensors, in `keras.ops`: every backend's guard compares these."""
    found: dict[str, Any] = {}
    for index, output in enumerate(tree.flatten(outputs)):
        dtype = keras.backend.standardize_dtype(getattr(output, "dtype", "int32"))
        if keras.ops.is_tensor(output) and len(output.shape) and "float" in dtype:
            found[f"output {index}"] = output
    for index, record in enumerate(records):
        if len(record.values.shape):
            found[f"loss {index}"] = reductions.per_example_values(record.values)
    return found


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
        "passes of one batch, once per model, compiled loss and batch signature; "
        "`model.check_example_independence = False` "
        "switches it off."
    )


def leading_size(x: Any) -> int | None:
    sizes = {
        int(value.shape[0])
        for value in tree.flatten(x)
        if hasattr(value, "shape") and len(value.shape) and value.shape[0] is not None
    }
    return sizes.pop() if len(sizes) == 1 else None


def others_replaced(data: Any, kept: int) -> Any:
    """`data` (any structure; None stays None) with its rows from `kept` on replaced by
    its first rows in reverse order (the batch size stays), in `keras.ops`."""
    if data is None:
        return None

    def replaced(value: Any) -> Any:
        if value is None:
            return None
        value = keras.ops.convert_to_tensor(value)
        size = keras.ops.shape(value)[0]
        return keras.ops.concatenate([value[:kept], keras.ops.flip(value[: size - kept], axis=0)])

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


def checked_independent(model: Any, find: Any, forward_may_not_apply: bool = False) -> bool:
    """Runs `find()` (the guard on one batch: `Mixing` or None) and raises its refusal;
    True where the batch passed (remembered as `model._examples_independent`).

    Args:
        model: The model checked (named in the refusal).
        find: Runs the guard's two forward passes.
        forward_may_not_apply: Whether a failure of the model's forward pass means
            the guard does not apply (skipped: False) rather than an error.
    """
    try:
        mixing = find()
    except Exception:
        if not forward_may_not_apply:
            raise
        return False
    if mixing is not None:
        raise mixing_error(model, mixing)
    model.__dict__["_examples_independent"] = True
    return True


def checked_once(
    model: Any, batch: tuple[Any, Any, Any], find: Any, forward_may_not_apply: bool = False
) -> None:
    """`checked_independent` once per model, compiled loss and batch signature: a model
    that passed on batches of the same structure, shapes past the batch axis and dtypes,
    compiled with the same loss, is not checked again (the guard finds mixing in the
    model's operations and its loss, which its weights' values leave as they are).

    Args:
        model: The model checked.
        batch: `(x, y, sample_weight)` of the batch (without example ids).
        find: Runs the guard's two forward passes on it.
        forward_may_not_apply: As for `checked_independent`.
    """
    loss = compiled_loss(model)
    signature = batch_signature(batch)
    passed = model.__dict__.get("_independent_batches")
    if passed is None or passed[0] is not loss:  # never passed, or compiled again
        passed = model.__dict__["_independent_batches"] = (loss, set())
    if signature in passed[1]:
        return
    passes = checked_independent(model, find, forward_may_not_apply)
    if passes and (leading_size(batch[0]) or 0) >= 2:  # a batch of one compares nothing
        passed[1].add(signature)


def batch_signature(batch: Any) -> str:
    """The structure, shapes past the batch axis and dtypes of `batch`'s tensors."""

    def spec(value: Any) -> Any:
        shape = getattr(value, "shape", None)
        if shape is None:
            return repr(value)
        return (tuple(shape)[1:], str(getattr(value, "dtype", "")))

    return repr(tree.map_structure(spec, batch))


class ExampleIndependenceSetting:
    """Every engine's mixin's setting `check_example_independence`, and the guard on one
    batch that each engine runs its own way (`_find_example_mixing`)."""

    def _find_example_mixing(self, x: Any, y: Any = None, sample_weight: Any = None) -> Any:
        """The guard on one batch at the model's current weights, changing nothing and
        not remembered (`kgt.check`'s): a `Mixing` where it fails, None where it holds."""
        raise NotImplementedError

    @property
    def check_example_independence(self) -> bool:
        """Whether a fit checks, before its first tracked step, that examples do not mix
        (default True).

        In inference mode, a batch runs as it is and with its second half
        replaced by other examples; the first half's outputs and per-example
        losses must not change, otherwise the step is refused before any weight
        changes (an operation mixes examples, so no per-example gradient is
        defined). It costs two forward passes of one batch, once per model,
        compiled loss and batch signature (a later fit with the same ones skips it).

        Example:

        ```python
        model.check_example_independence = False   # skip the check (at your own risk)
        ```
        """
        return bool(self.__dict__.get("_check_example_independence", True))

    @check_example_independence.setter
    def check_example_independence(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"Expected check_example_independence to be a bool. Received: {value!r}"
            )
        self.__dict__["_check_example_independence"] = value
