"""A model's own `train_step` on PyTorch: `self.tracked_backward(loss)` in place of `loss.backward()`.

Keras' torch `train_step(self, data)` runs the forward pass, computes the loss,
calls `loss.backward()` and hands `[v.value.grad for v in trainable_weights]` to
`optimizer.apply`. A model with its own step calls `self.tracked_backward(loss)`
where it would call `loss.backward()`: on untracked steps it is `loss.backward()`
itself; on a tracked step the whole `train_step` runs with a zero probe on each
tracked layer's output and the Keras losses' reductions recorded
(`engine/reductions.py`: example i's loss is its share of the recorded values, loss
weights and any scaling included), and `tracked_backward` differentiates the loss
with respect to the weights, the probes and the recorded values in one
`torch.autograd.grad`, leaves the weights' gradients on `v.value.grad` (a private
model's: the clipped, noised ones) and keeps the statistics for the step. A step
that calls `super().train_step(data)` reaches Keras' step through the mixin,
which on a tracked step is the same step with `tracked_backward`
(`GradientTrackingMixin._keras_tracked_step`).

Example:

```python
def train_step(self, data):
    x, y = data
    self.zero_grad()
    y_pred = self(x, training=True)
    loss = self.compute_loss(y=y, y_pred=y_pred)
    self.tracked_backward(loss)          # was: loss.backward()
    ...
```
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_gradtrack.backends.ops.loss_scale import recording_loss_scale
from keras_gradtrack.backends.ops.step import Tracking
from keras_gradtrack.backends.torch.forward import ProbedForward, recorded_losses

BACKEND = "PyTorch"
# Where a tracked step of the model's own `train_step` keeps its `ProbedForward`
# (in the model's `__dict__`, while the step runs).
OWN_STEP_KEY = "_own_step_forward"
# The ids of the trackings whose step has called `tracked_backward` once.
CHECKED_KEY = "_own_steps_checked"


def own_tracked_step(
    model: keras.Model, data: Any, tracking: Tracking
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's own `train_step` with the probes installed: `(logs, payload)`, the
    payload from its call of `tracked_backward` (a private model's logs gain the
    private step's values).

    Raises:
        NotImplementedError: When the step did not call `tracked_backward` (nor
            `super().train_step(data)`); on the first tracked step of a fit, the
            variables (the optimizer's too) are then put back as they were.
    """
    checked = model.__dict__.setdefault(CHECKED_KEY, set())
    if id(tracking) not in checked:
        # Known only once the step has run: undone if it turns out untracked.
        variables = [*model.variables, *(model.optimizer.variables if model.optimizer else [])]
        before = [(variable, ops.copy(variable.value)) for variable in variables]
        try:
            found = run_own_step(model, data, tracking)
        except NotImplementedError:
            for variable, value in before:
                variable.assign(value)
            raise
        checked.add(id(tracking))
        return found
    return run_own_step(model, data, tracking)


def run_own_step(
    model: keras.Model, data: Any, tracking: Tracking
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`own_tracked_step`, its first step not undone when it fails."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    forward = ProbedForward.of(tracking, x)
    if forward.inputs:
        data = keras.utils.pack_x_y_sample_weight(forward.x, y, sample_weight)
    model.__dict__[OWN_STEP_KEY] = forward
    try:
        with (
            forward.installed(model),
            recorded_losses(True) as forward.recorder,
            recording_loss_scale(model.optimizer) as forward.scales,
        ):
            logs = model.train_step(data)
    finally:
        model.__dict__.pop(OWN_STEP_KEY, None)
    if forward.payload is None:
        raise NotImplementedError(
            f"The train_step of {type(model).__name__} (a model's own train_step) did not "
            "call `self.tracked_backward(loss)` (nor `super().train_step(data)`), so this "
            f"tracked step has no per-example statistics on the {BACKEND} backend. Call it "
            "where the step calls `loss.backward()` (it leaves the same gradients on the "
            "weights); see GradientTrackingMixin.tracked_backward."
        )
    return {**logs, **forward.rows}, forward.payload
