"""The model classes of a probed engine: `GradientTrackingModel` (and the functional
variant it builds when given inputs) and `GradientTrackingSequential`, with the engine's
mixin, registered for `keras.models.load_model` under the package's name.

Example:

```python
GradientTrackingModel, FunctionalGradientTrackingModel, GradientTrackingSequential = (
    model_classes(GradientTrackingMixin, "PyTorch", __name__)
)
```
"""

from __future__ import annotations

import keras

from keras_gradtrack._keras_seam import Functional, FunctionalWhenGivenInputs, functional_variant

MODEL_DOC = """A `keras.Model` with per-example gradient tracking, on the {backend} backend.

    Use it exactly like `keras.Model`: functional (`GradientTrackingModel(inputs,
    outputs)`) or subclassed.

    Example:

    ```python
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(10)(hidden))
    ```
    """


def model_classes(mixin: type, backend: str, module: str) -> tuple[type, type, type]:
    """`(GradientTrackingModel, FunctionalGradientTrackingModel,
    GradientTrackingSequential)` with `mixin`, defined as classes of `module`."""
    register = keras.saving.register_keras_serializable(package="keras_gradtrack")
    model = register(
        type(
            "GradientTrackingModel",
            (mixin, FunctionalWhenGivenInputs, keras.Model),
            {"__doc__": MODEL_DOC.format(backend=backend), "__module__": module},
        )
    )
    functional = register(
        type(
            "FunctionalGradientTrackingModel",
            (model, Functional),
            {
                "__doc__": "What `GradientTrackingModel(inputs, outputs)` builds: a functional model.",
                "__module__": module,
            },
        )
    )
    functional_variant(model, functional)
    sequential = register(
        type(
            "GradientTrackingSequential",
            (mixin, keras.Sequential),
            {
                "__doc__": f"A `keras.Sequential` with per-example gradient tracking, on the "
                f"{backend} backend.",
                "__module__": module,
            },
        )
    )
    return model, functional, sequential
