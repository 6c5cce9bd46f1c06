"""Tracked equals plain on JAX: a tracked `fit` step trains exactly as Keras' own step."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from backend_models import MODELS, compiled
from backend_oracle import assert_trains_as_plain
from extended import with_extended

import keras_gradtrack as kgt
from keras_gradtrack import statistics

BATCH = 8


# The separable CNN's layers are each held to their rule in test_jax_layer_rules.py;
# the whole model's step: `make test-all`.
@pytest.mark.parametrize(
    "name",
    with_extended(sorted(MODELS), {"separable_cnn"}),
)
def test_a_tracked_step_trains_as_keras_does(name: str) -> None:
    build, shape = MODELS[name]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2 * BATCH, *shape)).astype("float32")
    y = rng.integers(0, 3, 2 * BATCH)
    tracked, plain = compiled(build(kgt.GradientTrackingModel)), compiled(build(keras.Model))
    assert_trains_as_plain(tracked, plain, x, y, BATCH)
    assert tracked.gradient_tracking.step == 2


def test_without_jit_the_statistics_are_the_same() -> None:
    build, shape = MODELS["mlp"]
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(BATCH, *shape)).astype("float32"), rng.integers(0, 3, BATCH)
    models = [compiled(build(kgt.GradientTrackingModel)) for _ in range(2)]
    models[1].compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    models[1].set_weights(models[0].get_weights())
    found = []
    for model in models:
        reports: list = []
        model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, reports.append)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        found.append(reports[0].values)
    for name, value in found[0].items():
        np.testing.assert_allclose(found[1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_model_saves_and_loads_as_its_class(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras", compile=False)
    assert isinstance(loaded, kgt.GradientTrackingModel)
    x = np.ones((2, 12), "float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
