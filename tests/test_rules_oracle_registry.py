"""Every registered rule against the oracle, driven by the registry (as BackPACK's tests
are by a settings table): one setting (a layer and its inputs) per registered class, run
in float32, under `mixed_float16` and XLA-compiled. A class registered without a
setting fails `test_every_registered_class_has_a_setting`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from keras.src.applications.convnext import LayerScale
from oracle import COSINE_ATOL, assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack import rules

L = keras.layers
BATCH = 6


@dataclasses.dataclass(frozen=True)
class Setting:
    """A layer of the class, and its inputs.

    Attributes:
        layer: Builds the layer (weights drawn at random, so no gradient vanishes).
        shape: One example's input shape.
        token_ids: Inputs are integer ids below this, instead of normal floats.
        full_batch: The layer couples the examples (BatchNormalization in training,
            opted in): the oracle takes each example's gradient from the full batch.
    """

    layer: Callable[[], Any]
    shape: tuple[int, ...]
    token_ids: int | None = None
    full_batch: bool = False

    def inputs(self, rng: np.random.Generator) -> np.ndarray:
        if self.token_ids is not None:
            return rng.integers(0, self.token_ids, (BATCH, *self.shape))
        return rng.normal(size=(BATCH, *self.shape)).astype("float32")


SETTINGS: dict[type, Setting] = {
    L.Dense: Setting(lambda: L.Dense(4, activation="tanh"), (3, 5)),
    L.Conv1D: Setting(lambda: L.Conv1D(3, 2, activation="relu"), (6, 2)),
    L.Conv2D: Setting(lambda: L.Conv2D(3, 2, padding="same"), (4, 4, 2)),
    L.Conv3D: Setting(lambda: L.Conv3D(2, 2), (3, 3, 3, 2)),
    L.DepthwiseConv1D: Setting(lambda: L.DepthwiseConv1D(2, depth_multiplier=2), (6, 3)),
    L.DepthwiseConv2D: Setting(lambda: L.DepthwiseConv2D(2), (4, 4, 2)),
    L.SeparableConv1D: Setting(lambda: L.SeparableConv1D(3, 2), (6, 2)),
    L.SeparableConv2D: Setting(lambda: L.SeparableConv2D(3, 2), (4, 4, 2)),
    L.Conv1DTranspose: Setting(lambda: L.Conv1DTranspose(3, 2), (4, 2)),
    L.Conv2DTranspose: Setting(lambda: L.Conv2DTranspose(3, 2, strides=2), (3, 3, 2)),
    L.Conv3DTranspose: Setting(lambda: L.Conv3DTranspose(2, 2), (2, 2, 2, 2)),
    L.Embedding: Setting(lambda: L.Embedding(7, 3), (5,), token_ids=7),
    L.LayerNormalization: Setting(lambda: L.LayerNormalization(), (3, 4)),
    L.GroupNormalization: Setting(lambda: L.GroupNormalization(groups=2), (3, 4)),
    L.RMSNormalization: Setting(lambda: L.RMSNormalization(), (3, 4)),
    L.EinsumDense: Setting(lambda: L.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d"), (3, 5)),
    L.BatchNormalization: Setting(lambda: L.BatchNormalization(), (3, 4), full_batch=True),
    L.PReLU: Setting(lambda: L.PReLU(alpha_initializer="random_uniform"), (3, 4)),
    LayerScale: Setting(lambda: LayerScale(0.5, 4), (3, 4)),
    L.RNN: Setting(lambda: L.RNN(L.SimpleRNNCell(3)), (4, 2)),
    L.SimpleRNN: Setting(lambda: L.SimpleRNN(3, return_sequences=True), (4, 2)),
    L.LSTM: Setting(lambda: L.LSTM(3), (4, 2)),
    L.GRU: Setting(lambda: L.GRU(3), (4, 2)),
}


def with_lora(
    layer: Callable[[], Any], shape: tuple[int, ...], rank: int, alpha: Any = None
) -> Any:
    """A layer built for inputs of `shape`, with LoRA (a random `b`: no gradient vanishes)."""

    def make() -> Any:
        built = layer()
        built.build((None, *shape))
        built.enable_lora(rank, lora_alpha=alpha, b_initializer="random_normal")
        return built

    return make


# The rules for configurations a class's own rule leaves out (`rules._CONFIGURATIONS`).
CONFIGURATION_SETTINGS: dict[str, Setting] = {
    "lora_dense": Setting(with_lora(lambda: L.Dense(4, activation="tanh"), (5,), 2, 3.0), (5,)),
    "lora_dense_sequence": Setting(with_lora(lambda: L.Dense(4), (3, 5), 3), (3, 5)),
    "lora_einsum_dense": Setting(
        with_lora(lambda: L.EinsumDense("btd,dnh->btnh", (3, 2, 2), bias_axes="nh"), (3, 5), 2, 4),
        (3, 5),
    ),
    "lora_embedding": Setting(with_lora(lambda: L.Embedding(7, 3), (5,), 2), (5,), token_ids=7),
}

# (relative tolerance for norms and losses, absolute tolerance for cosines) under
# mixed_float16, whose float16 keeps 11 significant bits (as in test_mixed_precision).
MIXED_FLOAT16 = (5e-3, 1e-2)
MODES = ["float32", "mixed_float16", "jit_compile", "norms_only"]
# Statistics that read no dots: the rule receives no Reference (its product-free path).
NORMS_ONLY = ["loss", "grad_norm", "layer_grad_norm", "gradient_diversity"]


def registered_classes() -> list[type]:
    return list(rules._REGISTRY)


def test_every_registered_class_has_a_setting() -> None:
    missing = [cls.__name__ for cls in registered_classes() if cls not in SETTINGS]
    assert not missing, (
        f"Registered layer classes without a setting in SETTINGS: {missing}. Add a layer "
        "and its inputs there (or remove a rule a test registered and did not unregister)."
    )


@pytest.fixture
def policy_restored() -> Iterator[None]:
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def build(setting: Setting, jit_compile: bool = False) -> Any:
    keras.utils.set_random_seed(3)
    inputs = keras.Input(setting.shape, dtype="int32" if setting.token_ids else "float32")
    hidden = L.Flatten()(setting.layer()(inputs))
    outputs = L.Dense(3, dtype="float32")(hidden)  # float32 logits under mixed precision
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    if setting.full_batch:
        model.track_batch_normalization = True
    return model


def fitted_statistics(model: Any, x: np.ndarray, y: np.ndarray, path: Path) -> dict[str, Any]:
    """The statistics of one tracked `fit` step, read back from its log."""
    logger = kgt.HDF5GradientLogger(path)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[logger])
    with kgt.GradientLog(path) as log:
        logged = {name: log.per_example(name) for name in log.per_example_names}
        logged.update({name: log.per_step(name)[0] for name in log.per_step_names})
    return logged


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer_class", list(SETTINGS), ids=lambda cls: cls.__name__)
def test_registered_rule_matches_the_oracle(
    layer_class: type, mode: str, tmp_path: Path, policy_restored: None
) -> None:
    assert_setting_matches_the_oracle(SETTINGS[layer_class], mode, tmp_path)


def test_every_configuration_rule_has_a_setting() -> None:
    names = {rule.name for rules_ in rules._CONFIGURATIONS.values() for rule in rules_}
    assert names <= {name.removesuffix("_sequence") for name in CONFIGURATION_SETTINGS}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CONFIGURATION_SETTINGS))
def test_configuration_rule_matches_the_oracle(
    name: str, mode: str, tmp_path: Path, policy_restored: None
) -> None:
    assert_setting_matches_the_oracle(CONFIGURATION_SETTINGS[name], mode, tmp_path)


def assert_setting_matches_the_oracle(setting: Setting, mode: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    x, y = setting.inputs(rng), rng.integers(0, 3, BATCH)
    reference = build(setting, jit_compile=mode == "jit_compile")
    tracked = reference.gradient_tracking_plan()[0]
    assert tracked.rule is not None, tracked.reason
    assert tracked.rule is rules.lookup(tracked.layer).rule
    expected = oracle_statistics(reference, x, y, full_batch=setting.full_batch)
    if mode == "float32":
        assert_matches_oracle(reference.gradient_statistics(x, y), expected)
    elif mode == "jit_compile":
        assert_matches_oracle(fitted_statistics(reference, x, y, tmp_path / "run.h5"), expected)
    elif mode == "norms_only":
        stats = reference.gradient_statistics(x, y, statistics=NORMS_ONLY)
        assert stats.keys() >= set(NORMS_ONLY)
        assert_matches_oracle(stats, expected)
    else:
        keras.mixed_precision.set_global_policy(mode)
        model = build(setting)
        model.set_weights(reference.get_weights())
        stats = model.gradient_statistics(x, y)
        rtol, cosine_atol = MIXED_FLOAT16
        for name in ("loss", "grad_norm", "layer_grad_norm", "batch_grad_norm"):
            np.testing.assert_allclose(stats[name], expected[name], rtol=rtol, err_msg=name)
        for name in ("cosine", "layer_cosine"):
            np.testing.assert_allclose(
                stats[name], expected[name], atol=max(cosine_atol, COSINE_ATOL), err_msg=name
            )
