"""What a logger may ask a tracked step for beside the statistics: per-example rows.

An `AttributionRequest` (the targets' products, a gradient sketch: see
`keras_gradtrack.attribution`) turns what the step's backward pass holds
(`BatchGradients`) into `(B, W)` rows; `attribution_rows` runs the step's requests
and gathers their rows over replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.attribution_requests import AttributionRequest
from keras_gradtrack.engine.backward import Backward, Calls
from keras_gradtrack.engine.plan import Plan
from keras_gradtrack.engine.tracking import TrackingContext
from keras_gradtrack.engine.tracking_check import COUPLED

__all__ = ["AttributionRequest", "BatchGradients", "attribution_rows"]


@dataclasses.dataclass(frozen=True)
class BatchGradients:
    """What an `AttributionRequest` reads of a tracked step after its backward pass.

    Attributes:
        model: The model.
        plan: The tracked layers the step's gradient covers.
        calls: Per layer, its calls with their output gradients (rules' scale).
        forms: Per layer, its form in this step.
        per_example: Per-example gradients of the materialized layers (rules' scale).
        factor: `c s`, the factor of the rules' scale (results of degree 1 divide by it).
        loss_scale: The step's loss scale, or None.
        xla: The step is compiled by XLA (the targets' calls are traced in it).
    """

    model: Any
    plan: Plan
    calls: tuple[Calls, ...]
    forms: Sequence[str]
    per_example: dict[int, Any]
    factor: Any
    loss_scale: Any | None
    xla: bool = False


def attribution_rows(
    context: TrackingContext,
    plan: Plan,
    backward: Backward,
    forms: Sequence[str],
    per_example: dict[int, Any],
) -> dict[str, Any]:
    """The rows of the step's attribution requests, by key, gathered over replicas."""
    if not context.requests:
        return {}
    coupled = [tracked.name for tracked, form in zip(plan, forms) if form == COUPLED]
    if coupled:
        raise ValueError(
            "Targets and gradient sketches pair each example's gradient of a layer with "
            "the targets' gradients of that layer alone, but the gradients of layers "
            f"{coupled} run through a BatchNormalization's batch statistics "
            "(model.track_batch_normalization). Freeze the BatchNormalization layers or "
            "use kgt.convert_to_group_normalization(model) to log targets or sketches."
        )
    batch = BatchGradients(
        context.model,
        plan,
        backward.calls,
        forms,
        per_example,
        backward.factor,
        context.loss_scale,
        context.xla,
    )
    rows = {request.key: request.rows(batch) for request in context.requests}
    return distribute.all_gather_rows(rows)
