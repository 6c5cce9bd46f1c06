"""`GradientTrackingModel` and `GradientTrackingSequential` on the JAX backend.

`keras_gradtrack.GradientTrackingModel` is this class when Keras runs on JAX
(`keras.backend.backend() == "jax"`); nothing here imports TensorFlow.
"""

from __future__ import annotations

import keras

from keras_gradtrack._keras_seam import Functional, FunctionalWhenGivenInputs, functional_variant
from keras_gradtrack.backends.jax.mixin import GradientTrackingMixin

__all__ = ["GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential"]


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingModel(GradientTrackingMixin, FunctionalWhenGivenInputs, keras.Model):
    """A `keras.Model` with per-example gradient tracking, on the JAX backend.

    Use it exactly like `keras.Model`: functional (`GradientTrackingModel(inputs,
    outputs)`) or subclassed.

    Example:

    ```python
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(10)(hidden))
    ```
    """


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class FunctionalGradientTrackingModel(GradientTrackingModel, Functional):
    """What `GradientTrackingModel(inputs, outputs)` builds: a functional model."""


functional_variant(GradientTrackingModel, FunctionalGradientTrackingModel)


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingSequential(GradientTrackingMixin, keras.Sequential):
    """A `keras.Sequential` with per-example gradient tracking, on the JAX backend."""
