"""The PyTorch engine's tests: Keras on PyTorch (`KERAS_BACKEND=torch`), seeded."""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("the PyTorch engine's tests run with KERAS_BACKEND=torch", allow_module_level=True)


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)
