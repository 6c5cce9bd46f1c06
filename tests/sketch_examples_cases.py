"""`kgt.attribution.sketch_examples` on a probed engine (JAX, PyTorch; each backend's
test module imports these): at each checkpoint, the sketches the engine's logger wrote
for the examples of the step that began there; the model's weights and its optimizer
are left as they were; the shared refusals hold; no TensorFlow is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
from sketched_runs import COUNT, MODELS, assert_logged_rows, logged_run, token_data, token_model
from without_tensorflow import run_without_tensorflow

import keras_gradtrack as kgt
from keras_gradtrack.io.checkpoints import checkpoint_directory


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_sketches_at_each_checkpoint_are_the_logged_rows_of_its_step(
    name: str, tmp_path: Path
) -> None:
    path = tmp_path / "run.h5"
    model, x, y, weight = logged_run(name, path)
    before = [keras.ops.convert_to_numpy(v) for v in model.variables]
    optimizer_state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    found = kgt.attribution.sketch_examples(path, model, x, y, weight, batch_size=5)
    for kept, now in zip(
        [*before, *optimizer_state], [*model.variables, *model.optimizer.variables]
    ):
        np.testing.assert_array_equal(kept, keras.ops.convert_to_numpy(now))
    assert sorted(found) == list(range(6))
    assert_logged_rows(path, found, COUNT)


def test_another_architecture_and_a_log_without_checkpoints_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model, x, y, _ = logged_run("dense", path)
    with pytest.raises(ValueError, match=r"variables differ. Expected \(in the log\) widths"):
        kgt.attribution.sketch_examples(path, token_model(), *token_data()[:2])
    shutil.rmtree(checkpoint_directory(path))
    with pytest.raises(ValueError, match="the log has no checkpoint"):
        kgt.attribution.sketch_examples(path, model, x, y)


def test_sketch_examples_needs_no_tensorflow(tmp_path: Path) -> None:
    # As on a GPU machine without TensorFlow: any import of it fails.
    body = """
        path = sys.argv[1]
        logger = kgt.HDF5GradientLogger(path, sketch_dim=2)
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4,
                  verbose=0, callbacks=[logger])
        found = kgt.attribution.sketch_examples(path, model, np.ones((3, 4)), np.zeros((3, 2)))
        assert {step: s.shape for step, s in found.items()} == {0: (3, 6)}
        assert "tensorflow" not in sys.modules
        """
    run_without_tensorflow(body, tmp_path / "run.h5")
