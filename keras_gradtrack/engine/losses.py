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
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.reductions import (
    REDUCTIONS,
    LossRecorder,
    factor_kind,
    recorded_reductions,
)


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


def recording_losses() -> contextlib.AbstractContextManager[LossRecorder]:
    """Wraps Keras' `reduce_values` for a block (`reductions.recorded_reductions`),
    recording each reduction's values as a fresh copy on the tape, with its factor.

    The swap holds process-wide for the block: the forward pass of a tracked step
    while it is traced (once per trace), the example-independence guard's two
    forward passes, and `kgt.check`'s trace.
    """

    def record(recorder: LossRecorder, values: Any, sample_weight: Any, reduction: str) -> Any:
        copy = tf.identity(values)
        kind = factor_kind(reduction, sample_weight)
        factor: tuple[Any, ...] = (kind,)
        if kind == "weights":
            factor = (kind, tf.reduce_sum(tf.cast(sample_weight, tf.float32)))
        recorder.records.append(LossRecord(copy, reduction, factor))
        return copy

    return recorded_reductions(record)


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
