"""Per-example losses from the batch loss: the reduction table.

Every Keras loss reduces its weighted per-element values `v` (the loss times
the sample and mask weights, shape `(B, ...)`) with Keras' `loss_module.
reduce_values`. While a tracked step is traced, that function is wrapped so
that each reduction's `v` (a fresh copy, whose gradient the backward pass also
takes) and its factor are recorded. The batch loss is linear in every `v`, so
example i's share of it is `s_i = sum_t v_it dL/dv_it`, loss weights, loss
scale and every reduction included. The table below says what `l_i` is for
each reduction, and the factor `c` with `L = c sum_i l_i` (on one replica of R):

| reduction | Keras divides `sum v` by | `l_i` | `c` |
| --- | --- | --- | --- |
| `"sum"` | 1 | `sum_t v_it` | 1 |
| `"sum_over_batch_size"`, `"mean"` | `B T R` (T positions per example) | `mean_t v_it` | `1 / (B R)` |
| `"mean_with_sample_weight"`, no weights | `B T R` | `mean_t v_it` | `1 / (B R)` |
| `"mean_with_sample_weight"`, weights `w` | `R sum(w)` | `sum_t v_it` | `1 / (R sum(w))` |

With several outputs, `l_i = sum_o weight_o l_oi` needs one `c` for all of
them; outputs whose factors differ (a `"sum"` and a mean, say) are refused, as
are `None`/`"none"` reductions (no scalar loss) and reductions Keras may add.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack._keras_seam import loss_module
from keras_gradtrack._patching import patched
from keras_gradtrack.engine import distribute

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
REDUCTIONS = ("sum", *MEAN_REDUCTIONS, "mean_with_sample_weight")


@dataclasses.dataclass(frozen=True)
class LossRecord:
    """One reduction of weighted loss values seen in the traced step.

    Attributes:
        values: The weighted values `v` `(B, ...)`, a fresh copy on the tape.
        reduction: The Keras reduction applied to them.
        factor: `("sum",)`, `("mean",)` or `("weights", sum(w))`: the kind of
            its `c` (equal kinds have equal `c`).
    """

    values: tf.Tensor
    reduction: str
    factor: tuple[Any, ...]


class LossRecorder:
    """Collects the `LossRecord`s of the losses computed while it is active."""

    def __init__(self) -> None:
        self.records: list[LossRecord] = []
        self.refused: list[str] = []
        # Reductions of a single value: a loss function that reduced the batch itself.
        self.whole_batch = 0


@contextlib.contextmanager
def recording_losses() -> Iterator[LossRecorder]:
    """Wraps Keras' `reduce_values` for the block, recording every reduction.

    The swap is of a module attribute, so it holds process-wide for the block: the
    forward pass of a tracked step while it is traced (once per trace), the
    example-independence guard's two forward passes, and `kgt.check`'s trace. A
    loss computed by another thread in that time would be recorded too (its value
    unchanged); the wrapper is removed on exit, however the block ends.
    """
    recorder = LossRecorder()
    original = loss_module.reduce_values

    def recording_reduce_values(values: Any, sample_weight: Any = None, reduction: Any = None):
        shape = tuple(getattr(values, "shape", ()))
        if reduction not in REDUCTIONS:
            recorder.refused.append(repr(reduction))
            return original(values, sample_weight, reduction)
        if shape in ((), (0,)):
            recorder.whole_batch += shape == ()
            return original(values, sample_weight, reduction)
        copy = tf.identity(values)
        if reduction == "sum":
            factor: tuple[Any, ...] = ("sum",)
        elif reduction == "mean_with_sample_weight" and sample_weight is not None:
            factor = ("weights", tf.reduce_sum(tf.cast(sample_weight, tf.float32)))
        else:
            factor = ("mean",)
        recorder.records.append(LossRecord(copy, reduction, factor))
        return original(copy, sample_weight, reduction)

    with patched(loss_module, "reduce_values", recording_reduce_values):
        yield recorder


def loss_factor(records: Sequence[LossRecord], batch_size: tf.Tensor) -> tf.Tensor:
    """`c` of the table for the recorded losses, which must share one.

    Raises:
        ValueError: When the losses' factors differ.
    """
    kinds = {record.factor[0] for record in records}
    weight_sums = {id(record.factor[1]) for record in records if record.factor[0] == "weights"}
    if len(kinds) > 1 or len(weight_sums) > 1:
        raise ValueError(
            "The losses of this model reduce with different factors, so one per-example "
            "loss l_i cannot weigh them as the batch loss does. Give every output a "
            "reduction of the same kind: all 'sum', or all means ('sum_over_batch_size', "
            "'mean', or 'mean_with_sample_weight' without sample weights). Received: "
            f"reductions={[record.reduction for record in records]}"
        )
    (kind,) = kinds
    replicas = float(distribute.num_replicas())
    if kind == "sum":
        return tf.constant(1.0)
    if kind == "weights":
        return 1.0 / (replicas * records[0].factor[1])
    return 1.0 / (replicas * tf.cast(batch_size, tf.float32))


def per_example_shares(
    records: Sequence[LossRecord], gradients: Sequence[tf.Tensor | None]
) -> tf.Tensor | None:
    """`(B,)` `s_i = sum_t v_it dL/dv_it` over the records; None if none reached the loss."""
    shares = []
    for record, gradient in zip(records, gradients):
        if gradient is None:
            continue
        product = tf.cast(record.values, tf.float32) * tf.cast(gradient, tf.float32)
        axes = list(range(1, product.shape.rank))
        shares.append(tf.reduce_sum(product, axis=axes) if axes else product)
    return tf.add_n(shares) if shares else None


def refuse_unknown_reductions(recorder: LossRecorder) -> None:
    """Raises when a loss used a reduction the table does not cover."""
    if recorder.refused:
        raise ValueError(
            "A loss of this step uses a reduction without a per-example factor, so its "
            f"per-example losses are not defined. Expected one of {list(REDUCTIONS)}. "
            f"Received: reduction={recorder.refused[0]}"
        )
