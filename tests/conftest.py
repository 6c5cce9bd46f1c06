"""Suite-wide setup: quiet TensorFlow, seeded Keras, one import per session."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import patience
import pytest
import tensorflow as tf

patience.imports_done()

# The JAX engine's tests need Keras on JAX, chosen when Keras is imported: they run
# in a process of their own (`KERAS_BACKEND=jax pytest tests/jax_backend`).
collect_ignore = [] if keras.backend.backend() == "jax" else ["jax_backend"]

# Two logical CPU devices, so tf.distribute.MirroredStrategy runs real replicas here.
# This must happen before TensorFlow initializes its devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)


@pytest.fixture(scope="session")
def two_cpu_strategy() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy over the two logical CPUs for the whole session.

    A second MirroredStrategy in the same process reuses collective instance keys
    and its all-reduces fail with "Shape mismatch in the collective instance"
    (plain Keras models too; tensorflow/tensorflow#62790).
    """
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    return strategy
