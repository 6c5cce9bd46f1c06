"""What a tracked step's forward pass on PyTorch leaves for its one backward pass.

The probes on the tracked layers' outputs (`probes.py`), the float inputs watched for
`input_grad_norm`, the Keras losses' recorded reductions (several outputs, loss
weights, a `compute_loss` or a `train_step` of one's own) and the loss scales
`optimizer.scale_loss` applied: `ProbedForward`, which the backward pass
(`GradientTrackingMixin._differentiated`) differentiates with respect to.

Example:

```python
forward = ProbedForward.of(tracking, x)
with forward.installed(model):
    y_pred = model(forward.x, training=True)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import torch

from keras_gradtrack.backends.ops.coupled import recording_mixing_calls
from keras_gradtrack.backends.ops.step import Tracking, batch_size_of
from keras_gradtrack.backends.torch.coupled import opted_in_mixing_layers
from keras_gradtrack.backends.torch.probes import Probes
from keras_gradtrack.engine import reductions
from keras_gradtrack.engine.reductions import LossRecorder
from keras_gradtrack.statistics import Statistic


@dataclasses.dataclass
class ProbedForward:
    """A tracked step's forward pass: what its backward pass differentiates.

    Attributes:
        tracking: What the step computes.
        probes: The probes of the tracked layers.
        x: The step's inputs (its float tensors the watched `inputs`, where the
            statistics need input gradients).
        inputs: The watched float inputs.
        batch: The batch size.
        recorder: The Keras losses' recorded reductions; None where the per-example
            losses are the compiled loss's on `targets`.
        targets: `(y, y_pred, sample_weight)` of the compiled loss.
        scales: The scales `optimizer.scale_loss` applied (`ops/loss_scale.py`).
        mixing: The BatchNormalization calls with the batch's moments, where the
            model opts in (`coupled.py`).
        payload: The statistics, once the backward pass has run.
        rows: The private step's values for the logs, once it has run.
    """

    tracking: Tracking
    probes: Probes
    x: Any
    inputs: list[Any]
    batch: int
    recorder: LossRecorder | None = None
    targets: tuple[Any, Any, Any] = (None, None, None)
    scales: list[Any] = dataclasses.field(default_factory=list)
    payload: dict[str, Any] | None = None
    rows: dict[str, Any] = dataclasses.field(default_factory=dict)
    mixing: list[tuple[Any, Any, bool]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, tracking: Tracking, x: Any) -> ProbedForward:
        """The forward pass of a step on inputs `x`, before it runs."""
        probes = Probes([tracked.layer for tracked in tracking.plan])
        inputs: list[Any] = []
        if needs_input_gradients(tracking.statistics):
            x, inputs = watched_inputs(x)
        return cls(tracking, probes, x, inputs, batch_size_of(x))

    @contextlib.contextmanager
    def installed(self, model: Any) -> Iterator[None]:
        """The probes installed for the block, and the BatchNormalization calls in
        training recorded where the model opts in (`coupled.py`)."""
        with (
            self.probes.installed(self.tracking.batchless, self.batch),
            recording_mixing_calls(opted_in_mixing_layers(model)) as self.mixing,
        ):
            yield


@contextlib.contextmanager
def recorded_losses(recording: bool) -> Iterator[LossRecorder | None]:
    """Records the losses' reductions for the block (`engine/reductions.py`), each
    value the tensor itself (autograd differentiates with respect to it); None
    without `recording`."""
    if not recording:
        yield None
        return
    with reductions.recording_losses(lambda values, position: values) as recorder:
        yield recorder


def needs_input_gradients(statistics: Sequence[Statistic]) -> bool:
    return any(statistic.needs_input_gradients for statistic in statistics)


def watched_inputs(x: Any) -> tuple[Any, list[Any]]:
    """`(x, its float tensors)`: `x` with each float tensor replaced by a leaf of its own
    that autograd differentiates with respect to (the caller's tensors stay as they
    are)."""
    floats: list[Any] = []

    def watched(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            floats.append(leaf.detach().requires_grad_(True))
            return floats[-1]
        return leaf

    x = keras.tree.map_structure(watched, x)
    if not floats:
        raise ValueError(
            "input_grad_norm is the gradient of each example's loss with respect to its "
            "float inputs; the model has none (the gradient with respect to integer "
            "inputs, such as token ids, is not defined)."
        )
    return x, floats


def detached(value: Any) -> Any:
    """`value` (a tensor, or a structure of them: a recurrent call's saved sequences)
    off the graph."""
    return keras.tree.map_structure(
        lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, value
    )
