"""Mixed precision: statistics of the unscaled gradients, close to the float32 oracle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from oracle import oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(5)
X = rng.normal(size=(16, 10)).astype("float32")
Y = rng.integers(0, 4, 16)

# (relative tolerance for norms and losses, absolute tolerance for cosines), per policy:
# float16 keeps 11 significant bits, bfloat16 8.
TOLERANCES = {"mixed_float16": (5e-3, 1e-2), "mixed_bfloat16": (3e-2, 5e-2)}


@pytest.fixture
def policy(request: pytest.FixtureRequest) -> Iterator[str]:
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def build() -> Any:
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    outputs = keras.layers.Dense(4, dtype="float32")(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


@pytest.mark.parametrize("policy", sorted(TOLERANCES), indirect=True)
def test_statistics_under_mixed_precision_match_the_float32_oracle(
    policy: str, tmp_path: Path
) -> None:
    keras.mixed_precision.set_global_policy("float32")
    reference = build()
    expected = oracle_statistics(reference, X, Y)
    keras.mixed_precision.set_global_policy(policy)
    model = build()
    model.set_weights(reference.get_weights())
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(
        X,
        Y,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    rtol, cosine_atol = TOLERANCES[policy]
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        for name in ("loss", "grad_norm", "layer_grad_norm"):
            np.testing.assert_allclose(
                log.per_example(name), expected[name], rtol=rtol, err_msg=name
            )
        for name in ("cosine", "layer_cosine"):
            np.testing.assert_allclose(
                log.per_example(name), expected[name], atol=cosine_atol, err_msg=name
            )
        # Unscaled: a loss scale of 2**15 would show here.
        np.testing.assert_allclose(
            log.per_step("batch_grad_norm")[0], expected["batch_grad_norm"], rtol=rtol
        )
