"""`GradientTrackingModel` and `GradientTrackingSequential`: Keras models whose `fit`
also computes exact per-example gradient statistics."""

from __future__ import annotations

import keras

from keras_gradtrack._keras_seam import Functional, FunctionalWhenGivenInputs, functional_variant
from keras_gradtrack.models.trainer import GradientTrackingMixin

__all__ = ["GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential"]


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingModel(GradientTrackingMixin, FunctionalWhenGivenInputs, keras.Model):
    """A `keras.Model` with per-example gradient tracking.

    Use it exactly like `keras.Model`: functional (`GradientTrackingModel(inputs,
    outputs)`) or subclassed. It saves and loads with `model.save()` /
    `keras.models.load_model()`.

    Example:

    ```python
    import keras, keras_gradtrack as kgt

    inputs = keras.Input((784,), name="pixels")
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit({"pixels": x, "example_id": ids}, y,
              callbacks=[kgt.HDF5GradientLogger("run.h5")])
    ```
    """


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class FunctionalGradientTrackingModel(GradientTrackingModel, Functional):
    """What `GradientTrackingModel(inputs, outputs)` builds: a functional model."""


functional_variant(GradientTrackingModel, FunctionalGradientTrackingModel)


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingSequential(GradientTrackingMixin, keras.Sequential):
    """A `keras.Sequential` with per-example gradient tracking.

    Example:

    ```python
    model = kgt.GradientTrackingSequential([
        keras.Input((20,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])
    ```
    """


# A legacy `.h5` file names the model class by its bare `__name__`, where a
# `.keras` file uses the registered "keras_gradtrack>..." name: register the bare
# names too, so that `keras.models.load_model("model.h5")` finds these classes.
keras.saving.get_custom_objects().update(
    {
        cls.__name__: cls
        for cls in (
            GradientTrackingModel,
            FunctionalGradientTrackingModel,
            GradientTrackingSequential,
        )
    }
)
