"""Keras' loss reductions, recorded: how both engines find the values each loss reduces.

Every Keras loss reduces its weighted per-element values `v` `(B, ...)` with
`loss_module.reduce_values`. `recorded_reductions` wraps that function for a
block; each engine says what it records of a reduction (TensorFlow: a fresh copy
of `v` on the tape, `engine/losses.py`; JAX: `v` plus its zero probe,
`backends/jax/losses.py`) and what the reduction then reduces. This module
imports no TensorFlow.

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
from collections.abc import Callable, Iterator
from typing import Any

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
