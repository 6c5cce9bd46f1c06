"""Suite-wide setup: quiet TensorFlow, seeded Keras, one import per session, and
`--shuffle` (`--shuffle-seed=N` to repeat an order) to run the tests in a random order
(the files, and the tests within each file)."""

import os
import random
import sys
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import patience
import pytest
import tensorflow as tf

patience.imports_done()

# The JAX and PyTorch engines' tests need Keras on their backend, chosen when Keras is
# imported: they run in a process of their own (`KERAS_BACKEND=jax pytest
# tests/jax_backend`, `KERAS_BACKEND=torch pytest tests/torch_backend`).
collect_ignore = [
    folder
    for backend, folder in (("jax", "jax_backend"), ("torch", "torch_backend"))
    if keras.backend.backend() != backend
]

# Two logical CPU devices, so tf.distribute.MirroredStrategy runs real replicas here.
# This must happen before TensorFlow initializes its devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def seeded() -> None:
    keras.utils.set_random_seed(1234)


TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def module_generators_reseeded(request: pytest.FixtureRequest) -> None:
    """Gives every test module's (and test helper module's) `rng` a generator seeded by
    the test's id, so a test draws the same data in any order (`--shuffle`), alone or
    in the whole suite."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(TESTS) and isinstance(getattr(module, "rng", None), np.random.Generator):
            seed = zlib.crc32(f"{request.node.nodeid}|{name}".encode())
            module.rng = np.random.default_rng(seed)


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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shuffle")
    group.addoption(
        "--shuffle",
        action="store_true",
        help="run the tests in a random order (its seed is printed at the top)",
    )
    group.addoption(
        "--shuffle-seed",
        type=int,
        default=None,
        help="run the tests in the random order of this seed (implies --shuffle)",
    )


def shuffle_seed(config: pytest.Config) -> int | None:
    """The seed of this run's test order; None: the order of the files."""
    seed = config.getoption("--shuffle-seed")
    if seed is None and config.getoption("--shuffle"):
        seed = random.SystemRandom().randrange(2**31)
        config.option.shuffle_seed = seed
    return seed


def report_order(config: pytest.Config) -> None:
    seed = shuffle_seed(config)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:
        reporter.write_line(f"test order shuffled: --shuffle-seed={seed} repeats it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = shuffle_seed(config)
    if seed is not None:
        # Every test seeds Keras, numpy and Python itself (`seeded`), and each module's
        # `rng` by the test's id: only the order changes.
        items[:] = shuffled_by_file(items, random.Random(seed))
        report_order(config)


def shuffled_by_file(items: list[pytest.Item], order: random.Random) -> list[pytest.Item]:
    """The files in a random order, and each file's tests in a random order within it
    (as pytest-randomly orders them): a file's module-scoped fixtures, such as the
    cross-backend workers, are set up once, not once per test."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(files.values())
    order.shuffle(groups)
    for group in groups:
        order.shuffle(group)
    return [item for group in groups for item in group]


def pytest_terminal_summary(config: pytest.Config) -> None:
    report_order(config)
