"""`GradientTrackingModel` and `GradientTrackingSequential` on the PyTorch backend.

`keras_gradtrack.GradientTrackingModel` is this class when Keras runs on PyTorch
(`keras.backend.backend() == "torch"`); nothing here imports TensorFlow or JAX.
"""

from __future__ import annotations

from keras_gradtrack.backends.ops.models import model_classes
from keras_gradtrack.backends.torch.mixin import GradientTrackingMixin

__all__ = ["GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential"]

GradientTrackingModel, FunctionalGradientTrackingModel, GradientTrackingSequential = model_classes(
    GradientTrackingMixin, "PyTorch", __name__
)
