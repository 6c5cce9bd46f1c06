"""Several epochs with a short last batch, on either backend (no backend imports
here): every step's rows in the log, oracle-exact. tests/test_short_last_batch.py
runs it on TensorFlow, tests/jax_backend/test_jax_short_last_batch.py on JAX, each
with its own model and oracle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np

import keras_gradtrack as kgt

EXAMPLES, BATCH, EPOCHS = 80, 64, 3


def assert_every_step_is_logged_oracle_exact(
    model: Any,
    path: Path,
    flush_seconds: float | None,
    oracle_statistics: Callable[..., dict[str, Any]],
    assert_matches_oracle: Callable[[dict[str, Any], dict[str, Any]], None],
) -> None:
    """Fits `model` (12 features, 3 classes) for EPOCHS epochs of a full batch and a
    short one, logging to `path`; every step's rows match `oracle_statistics`."""
    # A rate of zero keeps the weights, so every step's oracle is at the first weights.
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(EXAMPLES, 12)).astype("float32"), rng.integers(0, 3, EXAMPLES)
    ids = np.arange(EXAMPLES, dtype=np.int64) + 2**40
    logger = kgt.HDF5GradientLogger(path, flush_seconds=flush_seconds)
    history = model.fit(
        {"x": x, "example_id": ids},
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    assert len(history.history["loss"]) == EPOCHS

    log = kgt.GradientLog(path)
    rows = {name: log.per_example(name) for name in ("step", "epoch", "example_id")}
    sizes = [BATCH, EXAMPLES - BATCH] * EPOCHS
    assert rows["step"].tolist() == [s for s, n in enumerate(sizes) for _ in range(n)]
    assert rows["epoch"].tolist() == [e for e in range(EPOCHS) for _ in range(EXAMPLES)]
    assert rows["example_id"].tolist() == ids.tolist() * EPOCHS
    assert log.per_step("batch_size").tolist() == sizes
    batches = [slice(0, BATCH), slice(BATCH, EXAMPLES)]
    expected = [oracle_statistics(model, x[part], y[part]) for part in batches]
    for step in range(2 * EPOCHS):
        chosen = rows["step"] == step
        stats = {
            name: log.per_example(name)[chosen]
            for name in ("loss", "grad_norm", "cosine", "layer_grad_norm", "layer_cosine")
        }
        assert_matches_oracle(stats, expected[step % 2])
