"""keras-io's knowledge distillation example (tests/keras_io_distiller.py) on JAX:
it trains exactly as plain Keras, and its log holds every example's row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from jax_oracle import assert_trains_as_plain
from keras_io_distiller import distiller, expected_losses, mnist_shaped

import keras_gradtrack as kgt


def test_the_distiller_trains_tracked_as_plain_keras() -> None:
    x, y = mnist_shaped(32)
    assert_trains_as_plain(distiller(), distiller(), x, y, batch_size=16)


def test_the_distiller_logs_every_example(tmp_path: Path) -> None:
    x, y = mnist_shaped(40)
    model = distiller()
    model(x[:1])
    first_losses = expected_losses(model, x[:16], y[:16])
    path = tmp_path / "run.h5"
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path)],
    )
    assert len(history.history["loss"]) == 2
    with kgt.GradientLog(path) as log:
        assert log.per_step("batch_size").tolist() == [16, 16, 8] * 2
        losses = log.per_example("loss")
        assert losses.shape == (80,)
        np.testing.assert_allclose(losses[:16], first_losses, rtol=1e-4)
        assert np.all(np.isfinite(log.per_example("grad_norm")))
