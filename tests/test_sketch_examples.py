"""`kgt.attribution.sketch_examples`: examples' sketches at each checkpoint of a log.

An example trained on in the step that began at a checkpoint has, at that checkpoint,
the sketch the logger wrote for it in that step (models that call the same in training
and inference); the model's weights and its optimizer are left as they were.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
from sketched_runs import (
    COUNT,
    MODELS,
    assert_logged_rows,
    dense_model,
    logged_run,
    token_data,
    token_model,
)

import keras_gradtrack as kgt
from keras_gradtrack.io.checkpoints import checkpoint_directory


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_sketches_at_each_checkpoint_are_the_logged_rows_of_its_step(
    name: str, tmp_path: Path
) -> None:
    path = tmp_path / "run.h5"
    model, x, y, weight = logged_run(name, path)
    weights = [np.array(w) for w in model.get_weights()]
    optimizer_state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    # Another batch size than training's: the sketches do not depend on it.
    found = kgt.attribution.sketch_examples(path, model, x, y, weight, batch_size=5)
    for kept, now in zip(
        [*weights, *optimizer_state], [*model.get_weights(), *model.optimizer.variables]
    ):
        np.testing.assert_array_equal(kept, keras.ops.convert_to_numpy(now))
    assert sorted(found) == list(range(6))
    assert_logged_rows(path, found, COUNT)


def test_a_dict_input_with_example_ids_and_a_fresh_model_of_the_architecture(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.h5"
    _, x, y, weight = logged_run("dense", path, checkpoint_every=3)
    fresh = dense_model()  # other layer names and weights
    found = kgt.attribution.sketch_examples(path, fresh, x, y, weight)
    as_fit_takes_it = {"features": x, "example_id": np.arange(COUNT) + 100}
    again = kgt.attribution.sketch_examples(path, fresh, as_fit_takes_it, y, weight)
    assert sorted(found) == [0, 3]
    for step in found:
        np.testing.assert_array_equal(found[step], again[step])


def test_a_log_without_sketches_or_checkpoints_and_another_architecture_are_refused(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain.h5"
    model, x, y, _ = logged_run("dense", plain, sketch_dim=None, checkpoint_every=None)
    with pytest.raises(KeyError, match="written without sketch_dim"):
        kgt.attribution.sketch_examples(plain, model, x, y)
    path = tmp_path / "run.h5"
    model, x, y, _ = logged_run("dense", path)
    with pytest.raises(ValueError, match=r"variables differ. Expected \(in the log\) widths"):
        kgt.attribution.sketch_examples(path, token_model(), *token_data()[:2])
    with pytest.raises(ValueError, match="one row per example"):
        kgt.attribution.sketch_examples(path, model, x, y[:-1])
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        kgt.attribution.sketch_examples(path, model, x, y, batch_size=0)
    shutil.rmtree(checkpoint_directory(path))
    with pytest.raises(ValueError, match="the log has no checkpoint"):
        kgt.attribution.sketch_examples(path, model, x, y)
