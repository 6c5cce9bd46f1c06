"""Suite-wide setup: quiet TensorFlow, seeded Keras, one import per session."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import pytest


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)
