"""OutputGradientLogger: per-feature weight gradients during fit, exact, chunk by chunk."""

from __future__ import annotations

from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradtrack as kgt

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
