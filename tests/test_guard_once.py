"""The example-independence guard runs once per model, compiled loss and batch signature.

A later `fit` of a model that passed on batches of the same structure, shapes past the
batch axis and dtypes, with the same compiled loss, does not run the guard's two
forward passes again; another signature, a new `compile` or a batch of one (which
compares nothing) does, and a loss that mixes examples is still refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras import ops

import keras_gradtrack as kgt
from keras_gradtrack.models import trainer

rng = np.random.default_rng(8)
X = rng.normal(size=(32, 6)).astype("float32")
Y = rng.integers(0, 3, 32)


@pytest.fixture
def guard_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every run of the guard."""
    runs: list[int] = []
    find = trainer.find_example_mixing

    def counted(model: Any, x: Any, *args: Any) -> Any:
        runs.append(int(x.shape[0]))
        return find(model, x, *args)

    monkeypatch.setattr(trainer, "find_example_mixing", counted)
    return runs


def small_model() -> Any:
    inputs = keras.Input((6,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def fit(model: Any, path: Path, batch_size: int = 8, **kwargs: Any) -> None:
    logger = kgt.HDF5GradientLogger(path, overwrite=True)
    model.fit(X, Y, batch_size=batch_size, verbose=0, callbacks=[logger], **kwargs)


def test_a_second_fit_of_the_same_batches_skips_the_guard(
    guard_runs: list[int], tmp_path: Path
) -> None:
    model = small_model()
    fit(model, tmp_path / "run.h5")
    fit(model, tmp_path / "run.h5", batch_size=4)  # another batch size: the same signature
    assert guard_runs == [8]
    fit(model, tmp_path / "run.h5", sample_weight=np.ones(32))  # weights: a new signature
    assert guard_runs == [8, 8]


def test_a_batch_of_one_leaves_the_next_fit_checked(guard_runs: list[int], tmp_path: Path) -> None:
    model = small_model()
    fit(model, tmp_path / "run.h5", batch_size=1, steps_per_epoch=2)
    fit(model, tmp_path / "run.h5")
    assert guard_runs == [1, 8]


def test_a_loss_compiled_after_passing_is_checked_and_refused(
    guard_runs: list[int], tmp_path: Path
) -> None:
    model = small_model()
    fit(model, tmp_path / "run.h5")

    def centred(y_true: Any, y_pred: Any) -> Any:  # mixes: each loss minus the batch's mean
        losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        return losses - ops.mean(losses)

    model.compile(optimizer="sgd", loss=centred)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        fit(model, tmp_path / "run.h5")
    assert guard_runs == [8, 8]
