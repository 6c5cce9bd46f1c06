"""Per-example losses on JAX from the losses a function computes: Keras' reductions, recorded.

Every Keras loss reduces its weighted per-element values `v` (the loss times the
sample and mask weights, shape `(B, ...)`) with Keras' `reduce_values`. While it
is wrapped (`recording_losses`), each reduction's `v` is recorded, with a zero
probe added when given, whose gradient is `dL/dv`. The loss `L` a function
returns is linear in every `v`, so example i's share of it is
`s_i = sum_t v_it dL/dv_it` (loss weights, several losses and any scaling
included), and `l_i = s_i / c`, `c` the reduction's factor (`L = c sum_i l_i`):

| reduction | Keras divides `sum v` by | `c` |
| --- | --- | --- |
| `"sum"` | 1 | 1 |
| `"sum_over_batch_size"`, `"mean"`, `"mean_with_sample_weight"` without weights | `B T` | `1 / B` |
| `"mean_with_sample_weight"`, weights `w` | `sum(w)` | `1 / sum(w)` |

The TensorFlow engine's table (`engine/losses.py`) is the same, per replica.

Example:

```python
with recording_losses(loss_probes) as recorder:
    loss = model.compute_loss(x, y, y_pred)
recorder.records[0].values      # (B, ...) weighted values, probe added
```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from keras_gradtrack.backends.jax.plan import BACKEND
from keras_gradtrack.engine.reductions import (
    REDUCTIONS,
    LossRecorder,
    factor_kind,
    recorded_reductions,
)


@dataclasses.dataclass(frozen=True)
class LossRecord:
    """One reduction of weighted loss values seen while recording.

    Attributes:
        values: The weighted values `v` `(B, ...)` (plus their probe, when given).
        kind: `"sum"`, `"mean"` or `"weights"`: the kind of its factor `c`.
        weight_sum: `sum(w)` for the kind `"weights"`, else None.
    """

    values: Any
    kind: str
    weight_sum: Any = None


def recording_losses(
    probes: Sequence[Any] | None = None,
) -> contextlib.AbstractContextManager[LossRecorder]:
    """Wraps Keras' `reduce_values` for the block, recording every reduction.

    Args:
        probes: Zeros added to the recorded values, in the order of the
            reductions (their shapes from an earlier recording of the same
            computation); None adds nothing.

    The swap is of a module attribute, so it holds process-wide for the block (a
    trace of the function, or the guard's forward pass); the wrapper is removed
    on exit, however the block ends.
    """

    def record(recorder: LossRecorder, values: Any, sample_weight: Any, reduction: str) -> Any:
        if probes is not None:
            values = values + probes[len(recorder.records)].astype(values.dtype)
        kind = factor_kind(reduction, sample_weight)
        weight_sum = None
        if kind == "weights":
            weight_sum = jnp.sum(jnp.asarray(sample_weight, jnp.float32))
        recorder.records.append(LossRecord(values, kind, weight_sum))
        return values

    return recorded_reductions(record)


def per_example_values(record: LossRecord) -> Any:
    """`(B,)` sums of one record's values over all but the batch axis, in float32."""
    values = jnp.asarray(record.values, jnp.float32)
    return jnp.sum(values.reshape(values.shape[0], -1), axis=1)


def loss_factor(recorder: LossRecorder, batch: int) -> Any:
    """`c` (`L = c sum_i l_i`) of the recorded losses, which must share one.

    Raises:
        ValueError: When no Keras loss reduced per-example values, a loss used a
            reduction without a per-example factor, or the losses' factors differ.
    """
    if recorder.refused:
        raise ValueError(
            "A loss of this step uses a reduction without a per-example factor, so its "
            f"per-example losses are not defined. Expected one of {list(REDUCTIONS)}. "
            f"Received: reduction={recorder.refused[0]}"
        )
    if not recorder.records:
        raise ValueError(
            f"On the {BACKEND} backend the per-example losses l_i come from the Keras "
            "losses the differentiated function computes (a `keras.losses.Loss`, the "
            "compiled loss through `self.compute_loss`, or "
            "`self.compute_loss_and_updates`), and it computed none that reduces "
            f"per-example values (a loss reduced to one value itself: "
            f"{recorder.whole_batch}). Compute the loss with a keras.losses.Loss."
        )
    kinds = {record.kind for record in recorder.records}
    weighted = [record for record in recorder.records if record.kind == "weights"]
    if len(kinds) > 1 or len(weighted) > 1:
        raise ValueError(
            "The losses of this step reduce with different factors, so one per-example "
            "loss l_i cannot weigh them as the batch loss does. Give every loss a "
            "reduction of the same kind: all 'sum', or all means ('sum_over_batch_size', "
            "'mean', or 'mean_with_sample_weight' without sample weights). Received: "
            f"{sorted(record.kind for record in recorder.records)}"
        )
    for record in recorder.records:
        if record.values.shape[0] != batch:
            raise ValueError(
                f"A loss of this step reduced values of shape {tuple(record.values.shape)}, "
                f"whose first axis is not the batch (of {batch} examples), so its "
                "per-example losses are not defined."
            )
    (kind,) = kinds
    if kind == "sum":
        return jnp.float32(1.0)
    if kind == "weights":
        return 1.0 / weighted[0].weight_sum
    return jnp.float32(1.0 / batch)


def per_example_shares(records: Sequence[LossRecord], gradients: Sequence[Any]) -> Any:
    """`(B,)` `s_i = sum_t v_it dL/dv_it` over the records (`gradients`: their probes')."""
    shares = [
        per_example_values(dataclasses.replace(record, values=record.values * gradient))
        for record, gradient in zip(records, gradients)
    ]
    return sum(shares[1:], shares[0])
