"""keras-io's knowledge distillation example (tests/keras_io_distiller.py) on JAX:
it trains exactly as plain Keras, and its log holds every example's row."""

from __future__ import annotations

from pathlib import Path

from backend_oracle import assert_trains_as_plain
from keras_io_distiller import assert_logs_every_example, distiller, mnist_shaped


def test_the_distiller_trains_tracked_as_plain_keras() -> None:
    x, y = mnist_shaped(32)
    assert_trains_as_plain(distiller(), distiller(), x, y, batch_size=16)


def test_the_distiller_logs_every_example(tmp_path: Path) -> None:
    assert_logs_every_example(tmp_path / "run.h5")
