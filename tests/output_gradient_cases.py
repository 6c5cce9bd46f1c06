"""`OutputGradientLogger` on the probed engines (JAX and PyTorch; each backend's test
module imports these): every logged step's per-feature norms and tensors equal the
backend's own autodiff (the gradient of `sum(y[..., f])`, one feature at a time) at
the weights that step starts from. TensorFlow's are `test_output_logger.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np

import keras_gradtrack as kgt

RNG = np.random.default_rng(4)
PROBE = RNG.normal(size=(4, 12, 3)).astype("float32")
X = RNG.normal(size=(24, 12, 3)).astype("float32")
Y = RNG.normal(size=(24, 12, 10)).astype("float32")


def generator(model_class: type = keras.Model) -> Any:
    inputs = keras.Input((12, 3))
    hidden = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="conv")(inputs)
    model = model_class(inputs, keras.layers.Dense(10, name="head")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def feature_gradients(model: Any, x: np.ndarray) -> list[list[np.ndarray]]:
    """The oracle: `[feature][variable]`, the gradient of `sum(model(x)[..., f])` with
    respect to each trainable variable, by the backend's own autodiff."""
    backend = keras.backend.backend()
    count = int(model(x).shape[-1])
    if backend == "jax":
        import jax

        def total(values: Any, feature: int) -> Any:
            y, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables], x)
            return y[..., feature].sum()

        values = [v.value for v in model.trainable_variables]
        return [[np.asarray(g) for g in jax.grad(total)(values, f)] for f in range(count)]
    import torch

    found = []
    for feature in range(count):
        leaves = [v.value for v in model.trainable_variables]
        total = model(x)[..., feature].sum()
        found.append([g.detach().cpu().numpy() for g in torch.autograd.grad(total, leaves)])
    return found


def norms_of(grads: list[list[np.ndarray]]) -> np.ndarray:
    """`(features, layers)` for the generator's two layers of two variables each."""
    return np.array(
        [[np.sqrt(sum(np.sum(g**2) for g in per[i : i + 2])) for i in (0, 2)] for per in grads]
    )


def test_every_logged_step_equals_the_backends_own_gradients(tmp_path: Path) -> None:
    model = generator(kgt.GradientTrackingModel)
    replay = generator()
    replay.set_weights(model.get_weights())
    expected = [feature_gradients(replay, PROBE)]
    replay.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)  # to step 2's weights
    expected.append(feature_gradients(replay, PROBE))
    logger = kgt.OutputGradientLogger(
        tmp_path / "features.h5", PROBE, every_n_steps=2, chunk_size=4, save_tensors=True
    )
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
    with h5py.File(tmp_path / "features.h5", "r", swmr=True) as f:
        assert f.attrs["backend"] == keras.backend.backend()
        assert list(f["layers"].attrs["names"]) == ["conv", "head"]
        assert f["per_step/step"][:].tolist() == [0, 2]  # steps 0 and 2 of 3
        norms, kernel = f["per_step/output_grad_norm"][:], f["output_gradients/head/kernel"][:]
    assert norms.shape == (2, 10, 2) and kernel.shape == (2, 10, 8, 10)
    for row, grads in enumerate(expected):
        np.testing.assert_allclose(norms[row], norms_of(grads), rtol=1e-5)
        np.testing.assert_allclose(kernel[row], [g[2] for g in grads], rtol=1e-5, atol=1e-7)
    assert not np.allclose(norms[0], norms[1])  # the weights moved between them


def test_a_plain_keras_model_is_logged_by_its_layers(tmp_path: Path) -> None:
    model = generator()
    expected = norms_of(feature_gradients(model, PROBE))
    logger = kgt.OutputGradientLogger(tmp_path / "plain.h5", PROBE, every_n_steps=5, chunk_size=3)
    model.fit(X[:8], Y[:8], batch_size=8, verbose=0, callbacks=[logger])
    with h5py.File(tmp_path / "plain.h5", "r") as f:
        np.testing.assert_allclose(f["per_step/output_grad_norm"][0], expected, rtol=1e-5)
