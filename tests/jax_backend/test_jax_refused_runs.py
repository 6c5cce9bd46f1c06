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


def model() -> Any:
    inputs = keras.Input((4,))
    tracked = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2, name="out")(inputs))
    tracked.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return tracked


@pytest.mark.parametrize(
    "refused",
    [{"targets": (X[:2], Y[:2])}, {"statistics": ["loss", "input_grad_norm"]}],
    ids=["targets", "input_grad_norm"],
)
def test_a_refused_fit_leaves_no_file_and_the_corrected_fit_writes_the_path(
    tmp_path: Path, refused: dict[str, Any]
) -> None:
    path = tmp_path / "run.h5"
    with pytest.raises(NotImplementedError, match="JAX backend"):
        model().fit(X, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path, **refused)])
    assert list(tmp_path.iterdir()) == []
    model().fit(X, Y, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    with h5py.File(path, "r") as file:
        assert file["per_example/loss"].shape == (8,)
