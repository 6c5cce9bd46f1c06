"""On JAX too, a fit refused before its first step leaves no log file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

X, Y = np.ones((8, 4), "float32"), np.zeros(8, "int32")


def token_model() -> tuple[Any, np.ndarray]:
    inputs = keras.Input((4,), dtype="int32")
    features = keras.layers.Flatten()(keras.layers.Embedding(3, 2)(inputs))
    tracked = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2, name="out")(features))
    tracked.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return tracked, X.astype("int32")


@pytest.mark.parametrize(
    ("build", "refused", "error"),
    [
        (token_model, {"statistics": ["loss", "input_grad_norm"]}, ValueError),
    ],
    ids=["input_grad_norm of token ids"],
)
def test_a_refused_fit_leaves_no_file_and_the_corrected_fit_writes_the_path(
    tmp_path: Path, build: Any, refused: dict[str, Any], error: type
) -> None:
    path = tmp_path / "run.h5"
    tracked, x = build()
    with pytest.raises(error, match=r"JAX backend|float inputs"):
        tracked.fit(x, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, **refused)])
    assert list(tmp_path.iterdir()) == []
    tracked, x = build()
    tracked.fit(x, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    with h5py.File(path, "r") as file:
        assert file["per_example/loss"].shape == (8,)
