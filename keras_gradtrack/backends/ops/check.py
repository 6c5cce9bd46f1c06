"""`kgt.check` on the probed engines (JAX, PyTorch): the path each tracked layer will
take, and what a tracked step would refuse, known before training.

The rows come from the engine's plan (a rule, or the per-layer fallback); a layer or
model the engine refuses (a BatchNormalization in training without the opt-in, an
activity regularizer, variables outside layers) is the report's refusal, with the
error the first tracked step would raise. Given a batch, the example-independence
guard runs on it (two forward passes in inference mode, at the model's current
weights: nothing changes), as before the first tracked step of `fit`. Each rule takes
its form from the step's shapes: the forms are those of the last tracked step the
model traced (JAX) or ran (PyTorch), and given a batch with its targets, of a step
computed on it (`gradient_statistics`: the weights, the optimizer's state, the metrics
and the random state are left as they were); a step that refuses the batch is the
report's refusal. The report and its table are the TensorFlow engine's
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
    "Forms (-) are known on this backend once a tracked step has run, or from "
    "kgt.check(model, x=..., y=...) with a batch of the data."
)


def check(model: Any, x: Any, y: Any, sample_weight: Any) -> TrackingCheck:
    """`kgt.check` on JAX and PyTorch (`keras_gradtrack/checking.py`): the plan's rows,
    its refusal, and on a batch `x` the guard and the forms of a step computed on it."""
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
    refusals = []
    if inputs is not None and model.check_example_independence:  # type: ignore[attr-defined]
        mixing = model._find_example_mixing(inputs, y, sample_weight)  # type: ignore[attr-defined]
        if mixing is not None:
            refusals.append(str(mixing_error(model, mixing)))
    if inputs is not None and y is not None and not refusals:
        refusal = step_refusal(model, inputs, y, sample_weight)
        if refusal:
            refusals.append(refusal)
    forms = model.gradient_tracking.forms  # type: ignore[attr-defined]
    layers = tuple(
        layer_row(model, column, tracked, forms.get(tracked.name, UNKNOWN))
        for column, tracked in enumerate(plan)
    )
    traced = all(layer.form != UNKNOWN for layer in layers)
    return TrackingCheck(layers, tuple(refusals), traced, untraced_note=FORMS_NOT_PREDICTED)


def step_refusal(model: Any, x: Any, y: Any, sample_weight: Any) -> str:
    """The error a tracked step of the built-in `train_step` raises on this batch ("" if
    none), from `gradient_statistics` (which records the step's forms and changes no
    weight); "" without running for a model that is not compiled or has a `train_step`
    of its own."""
    if not model.compiled or model._has_own_step():
        return ""
    try:
        model.gradient_statistics(x, y, sample_weight)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        return str(error)
    return ""


def layer_row(model: Any, column: int, tracked: TrackedLayer, form: str) -> LayerPath:
    """A tracked layer's row: its rule (through BatchNormalization in training where
    coupled), or `fallback` with the engine's fallback named in the note."""
    if tracked.rule is None:
        path, note = FALLBACK, "; ".join(n for n in (tracked.path, tracked.reason) if n)
    else:
        path, note = model._layer_path(tracked), tracked.reason
    return tracked_layer_path(column, tracked, path, form, note)
