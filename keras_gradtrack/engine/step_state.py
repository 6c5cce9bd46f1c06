"""What the phases of a tracked step after its backward pass read: one frozen value."""

from __future__ import annotations

import dataclasses
from typing import Any

from keras_gradtrack.engine.backward import Backward, GradientRequest, Materialized, StepLayers
from keras_gradtrack.engine.coupled import CoupledGradients
from keras_gradtrack.engine.tracking import TrackingContext


@dataclasses.dataclass(frozen=True)
class StepState:
    """One tracked step after its backward pass (`engine.step` builds it once; the
    gradients, private, primitives and payload phases read it).

    Attributes:
        context: The step's tracking context.
        request: What the step asked for, `tape.gradient(loss, sources)`.
        layers: The tracked layers its gradient covers, and their forms.
        backward: The backward pass; `backward.calls` hold the output gradients.
        materialized: The materialized layers' per-example gradients and sums.
        penalties: Each regularized variable's penalty part of the gradient.
        coupled: The Jacobian rows of the coupled layers, if the step has any.
    """

    context: TrackingContext
    request: GradientRequest
    layers: StepLayers
    backward: Backward
    materialized: Materialized
    penalties: dict[int, Any]
    coupled: CoupledGradients | None = None
