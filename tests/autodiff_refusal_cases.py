"""`keras_gradtrack.autodiff` on JAX and PyTorch (each backend's test module imports
these): it differentiates with TensorFlow's tape, so a Keras model on another backend
is refused with what to use there, not a tape's error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest

from keras_gradtrack import autodiff

X = np.random.default_rng(2).normal(size=(3, 4)).astype("float32")


def model() -> Any:
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2)(inputs))


CALLS: dict[str, Callable[[Any], Any]] = {
    "grad": lambda m: autodiff.grad(lambda x: keras.ops.sum(m(x)), X),
    "vjp": lambda m: autodiff.vjp(m, X, np.ones((3, 2), "float32")),
    "jvp": lambda m: autodiff.jvp(m, X, np.ones((3, 4), "float32")),
    "jacobian": lambda m: autodiff.jacobian(m, X),
    "batch_jacobian": lambda m: autodiff.batch_jacobian(m, X),
    "output_gradients": lambda m: next(iter(autodiff.output_gradients(m, X))),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_autodiff_refuses_a_model_of_another_backend_saying_what_to_use(name: str) -> None:
    backend = keras.backend.backend()
    with pytest.raises(TypeError, match=f"TensorFlow's GradientTape, and Keras runs on {backend}"):
        CALLS[name](model())
