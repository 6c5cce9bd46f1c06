"""A private model saved with `model.save("m.keras")` loads private: the same bound(s),
groups, noise multiplier, expected batch size and steps taken, and it trains clipped."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import layers
from test_privacy import RTOL, compiled, expected_update, private_update

import keras_gradtrack as kgt


def mlp() -> Any:
    inputs = keras.Input((5,))
    hidden = layers.Dense(7, activation="tanh", name="hidden")(inputs)
    outputs = layers.Dense(3, name="logits")(layers.Dense(4, name="middle")(hidden))
    return compiled(kgt.GradientTrackingModel(inputs, outputs))


def data() -> tuple[np.ndarray, np.ndarray]:
    return np.random.default_rng(50).normal(size=(8, 5)).astype("float32"), np.arange(8) % 3


def test_settings_and_steps_survive_save_and_load(tmp_path: Any) -> None:
    x, y = data()
    model = mlp()
    model.make_private(
        l2_norm_clip={"body": 0.7, "head": 0.2},
        noise_multiplier=1.3,
        expected_batch_size=8,
        groups={"body": [model.get_layer("hidden"), "middle"], "head": ["logits"]},
    )
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    settings = loaded.privacy_settings
    assert settings is not None
    assert dict(settings.l2_norm_clip) == {"body": 0.7, "head": 0.2}
    assert {k: list(v) for k, v in settings.groups.items()} == {
        "body": ["hidden", "middle"],
        "head": ["logits"],
    }
    assert settings.noise_multiplier == 1.3 and settings.expected_batch_size == 8
    assert loaded.private_steps == 2
    loaded.fit(x, y, batch_size=4, verbose=0)
    assert loaded.private_steps == 4


def test_a_loaded_private_model_trains_clipped(tmp_path: Any) -> None:
    """Noise off: the first step after loading moves the weights by the oracle's
    clipped mean."""
    x, y = data()
    model = kgt.GradientTrackingSequential(
        [keras.Input((5,)), layers.Dense(6, activation="tanh"), layers.Dense(3)]
    )
    model = compiled(model)
    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.median(norms))
    expected, _ = expected_update(model, x, y, clip)
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_settings.l2_norm_clip == clip
    update = private_update(loaded, x, y)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_a_model_without_privacy_loads_without(tmp_path: Any) -> None:
    model = mlp()
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.privacy_settings is None and loaded.optimizer is not None
