"""OutputGradientLogger: per-feature weight gradients during fit, exact, chunk by chunk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt
from keras_gradtrack.callbacks import output_gradients

rng = np.random.default_rng(4)


def generator() -> keras.Model:
    inputs = keras.Input((12, 3))
    hidden = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def per_feature_tape_loop(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """The oracle: one persistent tape, one gradient call per feature; norms per layer."""
    layers = [layer for layer in model.layers if layer.trainable_weights]
    with tf.GradientTape(persistent=True) as tape:
        output = model(x)
        targets = [tf.reduce_sum(output[..., f]) for f in range(output.shape[-1])]
    norms = np.zeros((len(targets), len(layers)))
    for feature, target in enumerate(targets):
        for column, layer in enumerate(layers):
            grads = tape.gradient(target, layer.trainable_weights)
            norms[feature, column] = np.sqrt(sum(float(tf.reduce_sum(g**2)) for g in grads))
    return norms


def test_output_gradient_norms_and_tensors_match_a_per_feature_tape(tmp_path: Path) -> None:
    model = generator()
    probe = rng.normal(size=(4, 12, 3)).astype("float32")
    x, y = rng.normal(size=(24, 12, 3)), rng.normal(size=(24, 12, 10))
    expected = per_feature_tape_loop(model, probe)
    with tf.GradientTape(persistent=True) as tape:
        output = model(probe)
        targets = [tf.reduce_sum(output[..., f]) for f in range(10)]
    expected_kernel = np.stack([tape.gradient(t, model.layers[2].kernel) for t in targets])
    logger = kgt.OutputGradientLogger(
        tmp_path / "features.h5", probe, every_n_steps=2, chunk_size=4, save_tensors=True
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    with h5py.File(tmp_path / "features.h5", "r", swmr=True) as f:
        assert f.attrs["num_features"] == 10
        assert [n for n in f["layers"].attrs["names"]] == [
            model.layers[1].name,
            model.layers[2].name,
        ]
        norms = f["per_step/output_grad_norm"]
        assert norms.shape == (2, 10, 2)  # steps 0 and 2 of 3
        assert f["per_step/step"][:].tolist() == [0, 2]
        np.testing.assert_allclose(norms[0], expected, rtol=1e-5)
        kernel = f[f"output_gradients/{model.layers[2].name}/kernel"]
        assert kernel.shape == (2, 10, 8, 10)
        assert kernel.chunks[:2] == (1, 4)
        np.testing.assert_allclose(kernel[0], expected_kernel, rtol=1e-5, atol=1e-7)


def test_output_gradient_logger_refuses_a_wrong_axis(tmp_path: Path) -> None:
    model = generator()
    probe = rng.normal(size=(4, 12, 3)).astype("float32")
    logger = kgt.OutputGradientLogger(tmp_path / "features.h5", probe, axis=3)
    with pytest.raises(ValueError, match=r"output of shape \(4, 12, 10\)"):
        model.fit(probe, rng.normal(size=(4, 12, 10)), verbose=0, callbacks=[logger])


class ReadsTheLog(keras.callbacks.Callback):
    """After the logger's turn at each step, reads its file as another reader would."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.seen = path, []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        with h5py.File(self.path, "r", swmr=True) as f:
            lengths = {f[name].shape[0] for name in ("per_step/step", "per_step/epoch")}
            lengths.add(f["per_step/output_grad_norm"].shape[0])
            assert len(lengths) == 1  # every column of the table alike
            assert np.isfinite(f["per_step/output_grad_norm"][:]).all()
            self.seen.append(f["per_step/step"][:].tolist())


def test_the_output_gradient_log_is_made_like_the_gradient_log(tmp_path: Path) -> None:
    model = generator()
    path = tmp_path / "features.h5"
    probe = rng.normal(size=(4, 12, 3)).astype("float32")
    x, y = rng.normal(size=(24, 12, 3)), rng.normal(size=(24, 12, 10))
    logger = kgt.OutputGradientLogger(path, probe, every_n_steps=2, chunk_size=4)
    reader = ReadsTheLog(path)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[logger, reader])
    assert reader.seen == [[0], [0], [0, 2], [0, 2], [0, 2, 4], [0, 2, 4]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.h5"]  # no staging file
    with h5py.File(path, "r") as f:  # closed cleanly: plain h5py opens it
        assert f.attrs["output_gradients_schema_version"] == 1
        assert {"library_version", "keras_version", "model_name", "created"} <= set(f.attrs)
        assert (f.attrs["num_features"], f.attrs["axis"]) == (10, -1)
        # Rows not yet written read as fill values, never as plausible numbers.
        assert f["per_step/step"].fillvalue == -1
        assert np.isnan(f["per_step/output_grad_norm"].fillvalue)
        assert f["per_step/epoch"][:].tolist() == [0, 0, 1]


def test_the_output_gradient_logger_appends_or_refuses_an_existing_file(tmp_path: Path) -> None:
    model = generator()
    path = tmp_path / "features.h5"
    probe = rng.normal(size=(4, 12, 3)).astype("float32")
    x, y = rng.normal(size=(24, 12, 3)), rng.normal(size=(24, 12, 10))

    def fit(logger: Any) -> None:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[logger])

    fit(kgt.OutputGradientLogger(path, probe, every_n_steps=2))
    with pytest.raises(FileExistsError, match="append=True"):
        fit(kgt.OutputGradientLogger(path, probe, every_n_steps=2))
    fit(kgt.OutputGradientLogger(path, probe, every_n_steps=2, append=True))
    with h5py.File(path, "r") as f:
        assert f["per_step/step"][:].tolist() == [0, 2, 3, 5]  # on from the file's last step
    with pytest.raises(ValueError, match="its num_features differ"):
        fit(kgt.OutputGradientLogger(path, probe, axis=1, append=True))
    fit(kgt.OutputGradientLogger(path, probe, every_n_steps=3, overwrite=True))
    with h5py.File(path, "r") as f:
        assert f["per_step/step"][:].tolist() == [0]


def test_the_output_gradient_logger_uses_only_public_autodiff() -> None:
    source = Path(output_gradients.__file__).read_text()
    assert "autodiff.OutputGradients(" in source and "autodiff._" not in source
