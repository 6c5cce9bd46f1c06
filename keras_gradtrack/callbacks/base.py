"""What the package's callbacks share: who writes, and which models they need."""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.engine.preflight import steps_per_execution_refusal


def is_chief(model: Any) -> bool:
    """Whether this process writes the log: always, except non-chief multi-worker tasks."""
    resolver = getattr(model.distribute_strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    cluster = resolver.cluster_spec().as_dict()
    if "chief" in cluster:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def require_tracking_model(model: Any, callback: keras.callbacks.Callback) -> None:
    """Raises unless `model` can compute gradient statistics for `callback`."""
    from keras_gradtrack.models.trainer import GradientTrackingMixin

    if not isinstance(model, GradientTrackingMixin):
        raise TypeError(
            f"{type(callback).__name__} needs a model built with "
            "keras_gradtrack.GradientTrackingModel (or GradientTrackingMixin). "
            f"Received: a {type(model).__name__}"
        )
    if getattr(model, "steps_per_execution", 1) > 1:
        raise ValueError(steps_per_execution_refusal(model))
