"""A fit refused before its first step leaves no log file: the corrected fit writes the path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
X = rng.normal(size=(16, 4)).astype("float32")
Y = rng.integers(0, 3, 16)


class AddsLoss(keras.layers.Layer):
    def call(self, inputs: Any) -> Any:
        self.add_loss(keras.ops.sum(inputs))
        return inputs


def model_with(loss: Any = None, adds_loss: bool = False) -> Any:
    inputs = keras.Input((4,))
    features = AddsLoss()(inputs) if adds_loss else inputs
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3, name="out")(features))
    model.compile(
        optimizer="sgd", loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def two_outputs_of_different_reductions() -> Any:
    inputs = keras.Input((4,))
    outputs = {
        "a": keras.layers.Dense(3, name="a")(inputs),
        "b": keras.layers.Dense(3, name="b")(inputs),
    }
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd",
        loss={
            "a": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
            "b": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
    )
    return model


def fit(model: Any, path: Path, y: Any = Y, **logger_args: Any) -> None:
    logger = kgt.HDF5GradientLogger(path, **logger_args)
    model.fit(X, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])


REFUSED = {
    "add_loss": (lambda: model_with(adds_loss=True), Y, "add_loss"),
    "unreduced_loss": (
        lambda: model_with(keras.losses.SparseCategoricalCrossentropy(reduction=None)),
        Y,
        "reduction=None",
    ),
    "mixed_reductions": (two_outputs_of_different_reductions, {"a": Y, "b": Y}, "reductions="),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_fit_leaves_no_file_and_the_corrected_fit_writes_the_path(
    tmp_path: Path, case: str
) -> None:
    make_model, y, match = REFUSED[case]
    path = tmp_path / "run.h5"
    with pytest.raises(ValueError, match=match):
        fit(make_model(), path, y=y)
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []

    fit(model_with(), path)
    with h5py.File(path, "r") as file:
        assert file["per_example/loss"].shape == (16,)


def test_a_refused_fit_with_checkpoints_leaves_neither_file_nor_checkpoints(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.h5"
    with pytest.raises(ValueError, match="add_loss"):
        fit(model_with(adds_loss=True), path, checkpoint_every=1)
    assert list(tmp_path.iterdir()) == []
    fit(model_with(), path, checkpoint_every=1)
    assert path.exists()


def test_a_refused_fit_keeps_a_file_that_existed(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    fit(model_with(), path)
    with pytest.raises(ValueError, match="add_loss"):
        fit(model_with(adds_loss=True), path, append=True)
    with h5py.File(path, "r") as file:
        assert file["per_example/loss"].shape == (16,)


def test_a_fit_failing_after_its_first_step_keeps_its_rows(tmp_path: Path) -> None:
    class FailsAtSecondBatch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if batch == 1:
                raise RuntimeError("stop")

    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path)
    with pytest.raises(RuntimeError, match="stop"):
        model_with().fit(X, Y, batch_size=8, verbose=0, callbacks=[logger, FailsAtSecondBatch()])
    with h5py.File(path, "r") as file:
        assert file["per_example/loss"].shape == (8,)
