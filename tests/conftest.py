"""Suite-wide setup: quiet TensorFlow, seeded Keras, one import per session."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest
import tensorflow as tf

# Two logical CPU devices, so tf.distribute.MirroredStrategy runs real replicas here.
# This must happen before TensorFlow initializes its devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)
