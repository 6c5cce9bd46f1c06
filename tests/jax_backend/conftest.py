"""The JAX engine's tests: Keras on JAX (`KERAS_BACKEND=jax`), seeded."""

import keras
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX engine's tests run with KERAS_BACKEND=jax", allow_module_level=True)


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)
