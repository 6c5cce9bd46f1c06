"""Layers with LoRA (`enable_lora`) on the JAX engine's rules: Dense on 2-D and 3-D
inputs, EinsumDense (the kernel's last letter produced, shared or contracted),
Embedding with repeated ids, several ranks and alphas; against the `jax.grad` oracle,
and a tracked step that trains as Keras does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from backend_oracle import assert_trains_as_plain, tracked_statistics
from jax_oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.backends.jax import registry
from keras_gradtrack.backends.jax.plan import FALLBACK_PATH

L = keras.layers
BATCH = 6


def lora_model(
    model_class: type,
    shape: tuple[int, ...],
    layer: Callable[[], Any],
    rank: int,
    alpha: float | None = None,
    ids: int | None = None,
    twice: bool = False,
) -> Any:
    """`layer` between an input of `shape` and a classifier head (called twice: a shared
    layer), LoRA enabled on it with a random `b` (so that no factor's gradient vanishes)."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input(shape, dtype="int32" if ids else "float32")
    lora = layer()
    features = lora(lora(inputs)) if twice else lora(inputs)
    lora.enable_lora(rank, lora_alpha=alpha, b_initializer="random_normal")
    outputs = L.Dense(3, name="head")(L.Flatten()(features))
    model = model_class(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


SETTINGS: dict[str, dict[str, Any]] = {
    "dense_2d": dict(shape=(5,), layer=lambda: L.Dense(4, activation="tanh"), rank=2, alpha=3.0),
    "dense_3d": dict(shape=(7, 5), layer=lambda: L.Dense(4), rank=3),
    "dense_shared": dict(
        shape=(4,), layer=lambda: L.Dense(4, activation="tanh"), rank=2, twice=True
    ),
    "einsum_heads": dict(
        shape=(6, 5),
        layer=lambda: L.EinsumDense("btd,dnh->btnh", (6, 2, 3), bias_axes="nh"),
        rank=2,
        alpha=4,
    ),
    "einsum_abc": dict(
        shape=(3, 5),
        layer=lambda: L.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d"),
        rank=1,
        alpha=0.5,
    ),
    "einsum_shared_last": dict(
        shape=(3, 5, 2), layer=lambda: L.EinsumDense("btdh,dh->bth", (3, 2)), rank=2
    ),
    "einsum_contracted_last": dict(
        shape=(3, 5), layer=lambda: L.EinsumDense("abc,dc->abd", (3, 4)), rank=2, alpha=2
    ),
    "embedding": dict(shape=(5,), layer=lambda: L.Embedding(9, 4), rank=2, alpha=1.0, ids=9),
}
RULE_NAMES = {"dense": "lora_dense", "einsum": "lora_einsum_dense", "embedding": "lora_embedding"}


def inputs_for(setting: dict[str, Any], count: int = BATCH) -> np.ndarray:
    rng = np.random.default_rng(1)
    if setting.get("ids"):
        ids = rng.integers(0, setting["ids"], (count, *setting["shape"])).astype("int32")
        ids[:, 1] = ids[:, 0]  # repeated ids in every example
        return ids
    return rng.normal(size=(count, *setting["shape"])).astype("float32")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_lora_layers_are_on_their_rule_and_exact(name: str) -> None:
    setting = SETTINGS[name]
    model = lora_model(kgt.GradientTrackingModel, **setting)
    x, y = inputs_for(setting), np.arange(BATCH) % 3
    model(x[:1])
    paths = {t.name: t.path for t in model.gradient_tracking_plan()}
    (path,) = [p for n, p in paths.items() if not n.endswith("head")]
    assert path == f"rule:{RULE_NAMES[name.split('_')[0]]}", paths
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


@pytest.mark.parametrize("name", ["dense_3d", "einsum_heads", "embedding"])
def test_tracked_step_trains_as_plain_keras(name: str) -> None:
    setting = SETTINGS[name]
    tracked = lora_model(kgt.GradientTrackingModel, **setting)
    plain = lora_model(keras.Model, **setting)
    x = inputs_for(setting, 2 * BATCH)
    assert_trains_as_plain(tracked, plain, x, np.arange(2 * BATCH) % 3, BATCH)


def test_quantized_layers_stay_on_the_fallback() -> None:
    inputs = keras.Input((5,))
    dense = L.Dense(4)
    features = dense(inputs)
    dense.quantize("int8")
    model = kgt.GradientTrackingModel(inputs, L.Dense(3)(features))
    assert registry.lookup(dense) is None
    assert model.gradient_tracking_plan()[0].path == FALLBACK_PATH


def test_gpt2_causal_lm_with_lora_is_on_rules_and_exact() -> None:
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=32,
        dropout=0.0,
    )
    backbone.enable_lora(4)
    rng = np.random.default_rng(0)
    for variable in backbone.trainable_variables:
        if variable.name == "lora_kernel_b":  # no factor's gradient vanishes
            variable.assign(rng.normal(size=variable.shape) * 0.1)
    model_class = type(
        "TrackedGPT2CausalLM", (kgt.GradientTrackingMixin, keras_hub.models.GPT2CausalLM), {}
    )
    model = model_class(backbone, preprocessor=None)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    ids = rng.integers(1, 100, (4, 8))
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}, np.roll(ids, -1, axis=1)
    model(x)
    paths = [t.path for t in model.gradient_tracking_plan()]
    assert paths == ["rule:lora_einsum_dense"] * 4
    expected = oracle_statistics(model, x, y)  # before the tracked step changes the weights
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
