"""A tracked model overriding each user-overridable Keras method with the signature
Keras documents, without `training` where Keras allows that: `call(self, x)`,
`compute_loss(self, x, y, y_pred, sample_weight)` (Keras before 3.3),
`compute_metrics(self, x, y, y_pred, sample_weight)`, `test_step` and a metric's
`update_state(self, y_true, y_pred, sample_weight=None)`. Both backends' tests train
it; each override counts its calls (at trace time, as Keras traces them)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import keras
import numpy as np

import keras_gradtrack as kgt

CALLS: Counter[str] = Counter()


class CountingMean(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        CALLS["update_state"] += 1
        return super().update_state(keras.ops.mean(y_pred, axis=-1), sample_weight=sample_weight)


class Overriding(kgt.GradientTrackingModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(3)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, x):
        CALLS["call"] += 1
        return self.head(self.hidden(x))

    def compute_loss(self, x, y, y_pred, sample_weight):
        CALLS["compute_loss"] += 1
        return self.loss_fn(y, y_pred, sample_weight=sample_weight)

    def compute_metrics(self, x, y, y_pred, sample_weight):
        CALLS["compute_metrics"] += 1
        return super().compute_metrics(x, y, y_pred, sample_weight)

    if keras.backend.backend() == "jax":

        def test_step(self, state, data):
            CALLS["test_step"] += 1
            return super().test_step(state, data)

    else:

        def test_step(self, data):
            CALLS["test_step"] += 1
            return super().test_step(data)


def overriding_model() -> Overriding:
    model = Overriding()
    model.compile(optimizer="adam", metrics=[CountingMean(name="mean_output")])
    return model


def data(n: int = 24) -> tuple[Any, Any]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def assert_overrides_train_tracked(path: Path) -> None:
    """Fits and evaluates `overriding_model()` logged to `path`: every override is
    called, the metric reaches the logs, and every example has its row."""
    CALLS.clear()
    model = overriding_model()
    x, y = data()
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
