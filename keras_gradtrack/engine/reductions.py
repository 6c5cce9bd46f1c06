"""Keras' loss reductions, recorded: how both engines find the values each loss reduces.

Every Keras loss reduces its weighted per-element values `v` `(B, ...)` with
`loss_module.reduce_values`. `recorded_reductions` wraps that function for a
block; `recording_losses` records each reduction's `v` as the backend marks it
for differentiation (TensorFlow: a fresh copy of `v` on the tape,
`engine/losses.py`; JAX: `v` plus its zero probe, `backends/jax/losses.py`), with
the kind of its factor. From the records and the gradients of the marked values,
`per_example_shares` and `loss_factor` give the per-example losses
`l_i = s_i / c` on every backend. Written in `keras.ops`: this module imports no
backend.

Example:

```python
def record(recorder, values, sample_weight, reduction):
    recorder.records.append((values, factor_kind(reduction, sample_weight)))
    return values                      # what Keras then reduces

with recorded_reductions(record) as recorder:
    model.compute_loss(x=x, y=y, y_pred=model(x))
```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from keras_gradtrack._keras_seam import loss_module
from keras_gradtrack._patching import patched

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
REDUCTIONS = ("sum", *MEAN_REDUCTIONS, "mean_with_sample_weight")


@dataclasses.dataclass
class LossRecorder:
    """What the losses computed while recording reduced.

    Attributes:
        records: One per reduction of per-example values (the engine's records).
        refused: Reductions without a per-example factor (`None`, `"none"`, others).
        whole_batch: How many reductions received one value (a loss function that
            reduced the batch itself).
    """

    records: list[Any] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    whole_batch: int = 0


def factor_kind(reduction: str, sample_weight: Any) -> str:
    """`"sum"`, `"weights"` or `"mean"`: the kind of a reduction's factor `c`
    (`L = c sum_i l_i`; equal kinds have equal `c`, `"weights"` for equal `sum(w)`)."""
    if reduction == "sum":
        return "sum"
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        return "weights"
    return "mean"


Record = Callable[[LossRecorder, Any, Any, str], Any]


@contextlib.contextmanager
def recorded_reductions(record: Record) -> Iterator[LossRecorder]:
    """Wraps Keras' `reduce_values` for the block: each reduction of per-example
    values goes through `record(recorder, values, sample_weight, reduction)`, which
    records it and returns the values to reduce; other reductions are counted.

    The swap is of a module attribute, so it holds process-wide for the block (a
    trace of the step, the example-independence guard's forward passes, `kgt.check`'s
    trace); a loss computed by another thread in that time would be recorded too
    (its value unchanged). The wrapper is removed on exit, however the block ends.
    """
    recorder = LossRecorder()
    original = loss_module.reduce_values

    def recording_reduce_values(values: Any, sample_weight: Any = None, reduction: Any = None):
        shape = tuple(getattr(values, "shape", ()))
        if reduction not in REDUCTIONS:
            recorder.refused.append(repr(reduction))
        elif shape in ((), (0,)):
            recorder.whole_batch += shape == ()
        else:
            values = record(recorder, values, sample_weight, reduction)
        return original(values, sample_weight, reduction)

    with patched(loss_module, "reduce_values", recording_reduce_values):
        yield recorder


@dataclasses.dataclass(frozen=True)
class LossRecord:
    """One reduction of weighted loss values seen while recording.

    Attributes:
        values: The weighted values `v` `(B, ...)`, as the backend marked them.
        reduction: The Keras reduction applied to them.
        kind: `"sum"`, `"mean"` or `"weights"`: the kind of its factor `c`.
        weight_sum: `sum(w)` (float32) for the kind `"weights"`, else None.
    """

    values: Any
    reduction: str
    kind: str
    weight_sum: Any = None


# (the values a loss reduces, their position among this block's reductions) ->
# the values marked for differentiation (their gradient is `dL/dv`).
Mark = Callable[[Any, int], Any]


def recording_losses(mark: Mark) -> contextlib.AbstractContextManager[LossRecorder]:
    """Records every reduction of the block as a `LossRecord` of its marked values.

    Args:
        mark: How the backend marks the values for differentiation; Keras then
            reduces what it returns.
    """

    def record(recorder: LossRecorder, values: Any, sample_weight: Any, reduction: str) -> Any:
        values = mark(values, len(recorder.records))
        kind = factor_kind(reduction, sample_weight)
        weight_sum = None
        if kind == "weights":
            weight_sum = keras.ops.sum(keras.ops.cast(sample_weight, "float32"))
        recorder.records.append(LossRecord(values, reduction, kind, weight_sum))
        return values

    return recorded_reductions(record)


def per_example_values(values: Any) -> Any:
    """`(B,)` float32 sums of `(B, ...)` values over all but the batch axis."""
    values = keras.ops.cast(values, "float32")
    axes = tuple(range(1, len(values.shape)))
    return keras.ops.sum(values, axis=axes) if axes else values


def per_example_shares(records: Sequence[LossRecord], gradients: Sequence[Any]) -> Any:
    """`(B,)` `s_i = sum_t v_it dL/dv_it` over the records (`gradients`: their marked
    values'); None where no record reached the loss (every gradient None)."""
    shares = [
        per_example_values(
            keras.ops.cast(record.values, "float32") * keras.ops.cast(gradient, "float32")
        )
        for record, gradient in zip(records, gradients)
        if gradient is not None
    ]
    return sum(shares[1:], shares[0]) if shares else None


def refuse_unknown_reductions(recorder: LossRecorder) -> None:
    """Raises when a loss used a reduction the table does not cover."""
    if recorder.refused:
        raise ValueError(
            "A loss of this step uses a reduction without a per-example factor, so its "
            f"per-example losses are not defined. Expected one of {list(REDUCTIONS)}. "
            f"Received: reduction={recorder.refused[0]}"
        )


def loss_factor(records: Sequence[LossRecord], batch_size: Any, replicas: float = 1.0) -> Any:
    """`c` of the table (`L = c sum_i l_i`, on one replica of `replicas`) for the
    recorded losses, which must share one.

    Raises:
        ValueError: When the losses' factors differ.
    """
    kinds = {record.kind for record in records}
    weighted = [record for record in records if record.kind == "weights"]
    if len(kinds) > 1 or len(weighted) > 1:
        raise ValueError(
            "The losses of this step reduce with different factors, so one per-example "
            "loss l_i cannot weigh them as the batch loss does. Give every loss a "
            "reduction of the same kind: all 'sum', or all means ('sum_over_batch_size', "
            "'mean', or 'mean_with_sample_weight' without sample weights). Received: "
            f"reductions={[record.reduction for record in records]}"
        )
    (kind,) = kinds
    if kind == "sum":
        return keras.ops.convert_to_tensor(1.0, "float32")
    if kind == "weights":
        return 1.0 / (replicas * weighted[0].weight_sum)
    return 1.0 / (replicas * keras.ops.cast(batch_size, "float32"))
