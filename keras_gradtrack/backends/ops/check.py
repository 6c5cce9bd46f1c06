"""`kgt.check` on the probed engines (JAX, PyTorch): the path each tracked layer will
take, and what a tracked step would refuse, known before training.

The rows come from the engine's plan (a rule, or the per-layer fallback); a layer or
model the engine refuses (a BatchNormalization in training without the opt-in, an
activity regularizer, variables outside layers) is the report's refusal, with the
error the first tracked step would raise. Given a batch, the example-independence
guard runs on it (two forward passes in inference mode, at the model's current
weights: nothing changes), as before the first tracked step of `fit`. The forms are
not predicted: each rule takes its form from the step's shapes when the step is
traced. The report and its table are the TensorFlow engine's
(`engine/tracking_check.py`).

Example:

```python
report = kgt.check(model, x=x[:32], y=y[:32])
assert not report.refusals and not report.fallback_layers
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.ops.mixin import ProbedTrackingMixin
from keras_gradtrack.backends.ops.step import split_example_ids
from keras_gradtrack.engine.example_independence import mixing_error, rows
from keras_gradtrack.engine.tracked_layer import TrackedLayer
from keras_gradtrack.engine.tracking_check import (
    FALLBACK,
    UNKNOWN,
    LayerPath,
    TrackingCheck,
    tracked_layer_path,
)

FORMS_NOT_PREDICTED = (
    "Forms (-) are not predicted on this backend: each rule takes its form from the "
    "step's shapes when the step is traced."
)


def check(model: Any, x: Any, y: Any, sample_weight: Any) -> TrackingCheck:
    """`kgt.check` on JAX and PyTorch (`keras_gradtrack/checking.py`): the plan's rows,
    its refusal, and the guard on a batch `x`; forms are not predicted."""
    if not isinstance(model, ProbedTrackingMixin):
        raise TypeError(
            "Expected a Keras model with GradientTrackingMixin (kgt.GradientTrackingModel, "
            f"kgt.GradientTrackingSequential). Received: {type(model).__name__}"
        )
    inputs = None
    if x is not None:
        data, _ = split_example_ids(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))
        inputs, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not model.built:
            model(rows(inputs, 1), training=False)
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built yet; call it on a batch or `build()` it "
            "before checking how its layers will be tracked (or pass a batch: "
            "`kgt.check(model, x=...)`)."
        )
    try:
        plan = model.gradient_tracking_plan()  # type: ignore[attr-defined]
    except ValueError as error:
        return TrackingCheck((), (str(error),), False, untraced_note=FORMS_NOT_PREDICTED)
    layers = tuple(layer_row(model, column, tracked) for column, tracked in enumerate(plan))
    refusals = []
    if inputs is not None and model.check_example_independence:  # type: ignore[attr-defined]
        mixing = model._find_example_mixing(inputs, y, sample_weight)  # type: ignore[attr-defined]
        if mixing is not None:
            refusals.append(str(mixing_error(model, mixing)))
    return TrackingCheck(layers, tuple(refusals), False, untraced_note=FORMS_NOT_PREDICTED)


def layer_row(model: Any, column: int, tracked: TrackedLayer) -> LayerPath:
    """A tracked layer's row: its rule (through BatchNormalization in training where
    coupled), or `fallback` with the engine's fallback named in the note."""
    if tracked.rule is None:
        path, note = FALLBACK, "; ".join(n for n in (tracked.path, tracked.reason) if n)
    else:
        path, note = model._layer_path(tracked), tracked.reason
    return tracked_layer_path(column, tracked, path, UNKNOWN, note)
