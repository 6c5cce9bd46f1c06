"""Logged runs for `kgt.attribution.sketch_examples`'s tests, on either backend: small
models that call the same in training and inference, trained with sample weights and a
logger of gradient sketches; and the check of the sketches against the logged rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np

import keras_gradtrack as kgt

rng = np.random.default_rng(11)
BATCH = 8
COUNT = 3 * BATCH


def compiled(inputs: Any, outputs: Any) -> Any:
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def dense_model() -> Any:
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(12, activation="tanh")(inputs)
    return compiled(inputs, keras.layers.Dense(3)(hidden))


def token_model() -> Any:
    """A next-token model: Embedding, sequence Dense, LayerNormalization, per-token logits."""
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(11, 12)(inputs)
    hidden = keras.layers.Dense(10, activation="relu")(hidden)
    hidden = keras.layers.LayerNormalization()(hidden)
    return compiled(inputs, keras.layers.Dense(11)(hidden))


def dense_data() -> tuple[Any, Any, Any]:
    x = rng.normal(size=(COUNT, 5)).astype("float32")
    return x, rng.integers(0, 3, COUNT), rng.uniform(0.5, 2.0, COUNT).astype("float32")


def token_data() -> tuple[Any, Any, Any]:
    tokens = rng.integers(0, 11, (COUNT, 6)).astype("int32")
    weight = np.ones(tokens.shape, "float32")
    weight[:, -1] = 0.0  # per-token sample weights, as a language model's last token
    return tokens, np.roll(tokens, -1, axis=1), weight


MODELS = {"dense": (dense_model, dense_data), "tokens": (token_model, token_data)}


def logged_run(name: str, path: Path, **logger: Any) -> tuple[Any, Any, Any, Any]:
    build, make_data = MODELS[name]
    model = build()
    x, y, weight = make_data()
    logger = {"sketch_dim": 4, "checkpoint_every": 1, **logger}
    model.fit(
        x,
        y,
        sample_weight=weight,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path, **logger)],
    )
    return model, x, y, weight


def assert_logged_rows(path: Path, found: dict[int, np.ndarray], count: int) -> None:
    """At each checkpoint, the examples trained on in the step that began there have the
    sketches the logger wrote for them (rtol 1e-5)."""
    with kgt.GradientLog(path) as log:
        steps, ids = log.per_example("step"), log.per_example("example_id")
        rows = log.per_example("gradient_sketch")
        assert sorted(found) == sorted(log.checkpoints())
    for step, sketches in found.items():
        assert sketches.shape == (count, rows.shape[1]) and sketches.dtype == np.float32
        of_step = steps == step
        assert of_step.any()
        np.testing.assert_allclose(
            sketches[ids[of_step]], rows[of_step], rtol=1e-5, atol=1e-5 * np.abs(rows).max()
        )
