"""A model overriding Keras' methods with Keras' documented signatures trains tracked
(tests/keras_signatures.py); the library calls each as Keras' trainer does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from keras_signatures import CALLS, data, overriding_model

import keras_gradtrack as kgt


def test_overrides_with_keras_signatures_train_tracked(tmp_path: Path) -> None:
    CALLS.clear()
    model = overriding_model()
    x, y = data()
    path = tmp_path / "run.h5"
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        validation_data=(x, y),
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path)],
    )
    model.evaluate(x, y, verbose=0)
    assert {"call", "compute_loss", "compute_metrics", "test_step", "update_state"} <= set(CALLS)
    assert "val_mean_output" in history.history
    with kgt.GradientLog(path) as log:
        assert log.per_example("loss").shape == (48,)
        assert np.all(np.isfinite(log.per_example("cosine")))
