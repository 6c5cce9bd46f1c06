"""`GradientTrackingModel` and `GradientTrackingSequential` on the JAX backend.

`keras_gradtrack.GradientTrackingModel` is this class when Keras runs on JAX
(`keras.backend.backend() == "jax"`); nothing here imports TensorFlow.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack._keras_seam import Functional, functional_init_arguments
from keras_gradtrack.backends.jax.mixin import GradientTrackingMixin

__all__ = ["GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential"]


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingModel(GradientTrackingMixin, keras.Model):
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

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Keras makes a `Model` subclass functional by rewriting its bases in
        # place; a functional variant of the class keeps both styles working.
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = functional_variant(cls)
        return super().__new__(cls)


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class FunctionalGradientTrackingModel(GradientTrackingModel, Functional):
    """What `GradientTrackingModel(inputs, outputs)` builds: a functional model."""


FUNCTIONAL_VARIANTS: dict[type, type] = {GradientTrackingModel: FunctionalGradientTrackingModel}


def functional_variant(cls: type) -> type:
    """`cls` with `Functional` mixed in (same name and module, so saving finds `cls`)."""
    if cls not in FUNCTIONAL_VARIANTS:
        FUNCTIONAL_VARIANTS[cls] = type(
            cls.__name__,
            (cls, Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return FUNCTIONAL_VARIANTS[cls]


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingSequential(GradientTrackingMixin, keras.Sequential):
    """A `keras.Sequential` with per-example gradient tracking, on the JAX backend."""
