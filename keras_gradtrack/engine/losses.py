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
from typing import Any

import keras

from keras_gradtrack.engine import distribute, reductions
from keras_gradtrack.engine.reductions import LossRecorder

__all__ = ["loss_factor", "recording_losses"]


def recording_losses() -> contextlib.AbstractContextManager[LossRecorder]:
    """Wraps Keras' `reduce_values` for a block (`reductions.recording_losses`),
    recording each reduction's values as a fresh copy on the tape, with its factor.

    The swap holds process-wide for the block: the forward pass of a tracked step
    while it is traced (once per trace), the example-independence guard's two
    forward passes, and `kgt.check`'s trace.
    """
    return reductions.recording_losses(lambda values, _: keras.ops.copy(values))


def loss_factor(records: Any, batch_size: Any) -> Any:
    """`c` of the table for the recorded losses on one replica (`reductions.loss_factor`).

    Raises:
        ValueError: When the losses' factors differ.
    """
    return reductions.loss_factor(records, batch_size, float(distribute.num_replicas()))
