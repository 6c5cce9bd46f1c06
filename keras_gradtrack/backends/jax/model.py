"""`GradientTrackingModel` and `GradientTrackingSequential` on the JAX backend.

`keras_gradtrack.GradientTrackingModel` is this class when Keras runs on JAX
(`keras.backend.backend() == "jax"`); nothing here imports TensorFlow.
"""

from __future__ import annotations

from keras_gradtrack.backends.jax.mixin import GradientTrackingMixin
from keras_gradtrack.backends.ops.models import model_classes

__all__ = ["GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential"]

GradientTrackingModel, FunctionalGradientTrackingModel, GradientTrackingSequential = model_classes(
    GradientTrackingMixin, "JAX", __name__
)
