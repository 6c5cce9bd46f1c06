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
from collections.abc import Sequence
from typing import Any

from keras_gradtrack.backends.ops.step import recorded_loss_factor
from keras_gradtrack.engine import reductions
from keras_gradtrack.engine.reductions import LossRecorder

__all__ = ["loss_factor", "recording_losses"]


def recording_losses(
    probes: Sequence[Any] | None = None,
) -> contextlib.AbstractContextManager[LossRecorder]:
    """Wraps Keras' `reduce_values` for the block (`reductions.recording_losses`),
    recording every reduction's values plus its zero probe.

    Args:
        probes: Zeros added to the recorded values, in the order of the
            reductions (their shapes from an earlier recording of the same
            computation); None adds nothing.

    The swap is of a module attribute, so it holds process-wide for the block (a
    trace of the function, or the guard's forward pass); the wrapper is removed
    on exit, however the block ends.
    """

    def mark(values: Any, position: int) -> Any:
        if probes is None:
            return values
        return values + probes[position].astype(values.dtype)

    return reductions.recording_losses(mark)


def loss_factor(recorder: LossRecorder, batch: int) -> Any:
    """`c` (`L = c sum_i l_i`) of the recorded losses (`ops.step.recorded_loss_factor`)."""
    return recorded_loss_factor(recorder, batch)
