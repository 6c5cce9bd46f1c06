"""The JAX engine: per-example gradient statistics from one `jax.value_and_grad`.

Chosen by `keras_gradtrack` when Keras runs on JAX; it imports no TensorFlow.
"""

from keras_gradtrack.backends.jax.mixin import GradientTrackingMixin
from keras_gradtrack.backends.jax.model import (
    GradientTrackingModel,
    GradientTrackingSequential,
)
from keras_gradtrack.backends.ops.check import check

__all__ = [
    "GradientTrackingMixin",
    "GradientTrackingModel",
    "GradientTrackingSequential",
    "check",
]
