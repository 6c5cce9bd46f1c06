"""Layers with LoRA (`enable_lora`) on their rules: Dense on 2-D and 3-D inputs,
EinsumDense (the kernel's last letter produced, shared or contracted), Embedding with
repeated ids, several ranks and alphas; against the oracle in each form the rule can
take (Gram, materialized, norms only), privately (the clipped mean) and as plain Keras."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from invariant import assert_tracked_step_equals_plain
from oracle import assert_matches_oracle, oracle_statistics
from test_privacy import assert_clipped_update

import keras_gradtrack as kgt
from keras_gradtrack import rule_math, rules

L = keras.layers
BATCH = 6
NORMS_ONLY = ["loss", "grad_norm", "layer_grad_norm", "gradient_diversity"]


def with_lora(
    layer: Any, inputs: Any, rank: int, alpha: float | None = None, twice: bool = False
) -> Any:
    """The layer called on `inputs` (twice: a shared layer), then LoRA enabled, with a
    random `b` so that no factor's gradient vanishes."""
    outputs = layer(layer(inputs)) if twice else layer(inputs)
    layer.enable_lora(rank, lora_alpha=alpha, b_initializer="random_normal")
    return outputs


def classifier(inputs: Any, features: Any) -> Any:
    outputs = L.Dense(3, name="head")(L.Flatten()(features))
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def floats_model(shape: tuple[int, ...], layer: Callable[[], Any], **lora: Any) -> Any:
    def build() -> tuple[Any, np.ndarray]:
        keras.utils.set_random_seed(5)
        inputs = keras.Input(shape)
        model = classifier(inputs, with_lora(layer(), inputs, **lora))
        x = np.random.default_rng(1).normal(size=(BATCH, *shape)).astype("float32")
        return model, x

    return build


def token_model(length: int, **lora: Any) -> Callable[[], tuple[Any, np.ndarray]]:
    def build() -> tuple[Any, np.ndarray]:
        keras.utils.set_random_seed(5)
        inputs = keras.Input((length,), dtype="int32")
        model = classifier(inputs, with_lora(L.Embedding(9, 4), inputs, **lora))
        ids = np.random.default_rng(1).integers(0, 9, (BATCH, length)).astype("int32")
        ids[:, 1] = ids[:, 0]  # repeated ids in every example
        return model, ids

    return build


MODELS = {
    "dense_2d": floats_model((5,), lambda: L.Dense(4, activation="tanh"), rank=2, alpha=3.0),
    "dense_3d": floats_model((7, 5), lambda: L.Dense(4), rank=3),
    "dense_shared": floats_model((4,), lambda: L.Dense(4, activation="tanh"), rank=2, twice=True),
    "einsum_heads": floats_model(
        (6, 5), lambda: L.EinsumDense("btd,dnh->btnh", (6, 2, 3), bias_axes="nh"), rank=2, alpha=4
    ),
    "einsum_abc": floats_model(
        (3, 5), lambda: L.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d"), rank=1, alpha=0.5
    ),
    "einsum_shared_last": floats_model(
        (3, 5, 2), lambda: L.EinsumDense("btdh,dh->bth", (3, 2)), rank=2
    ),
    "einsum_contracted_last": floats_model(
        (3, 5), lambda: L.EinsumDense("abc,dc->abd", (3, 4), bias_axes="d"), rank=2, alpha=2
    ),
    "embedding": token_model(5, rank=2, alpha=1.0),
    "embedding_long": token_model(40, rank=3),
}
RULE_NAMES = {"dense": "lora_dense", "einsum": "lora_einsum_dense", "embedding": "lora_embedding"}


def lora_layer(model: Any) -> Any:
    (tracked,) = [t for t in model.gradient_tracking_plan() if t.layer.name != "head"]
    return tracked


@pytest.mark.parametrize("name", sorted(MODELS))
def test_lora_layers_are_on_their_rule_and_exact(name: str) -> None:
    model, x = MODELS[name]()
    y = np.arange(BATCH) % 3
    tracked = lora_layer(model)
    assert tracked.rule is not None, tracked.reason
    assert tracked.rule.name == RULE_NAMES[name.split("_")[0]]
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y), expected)
    assert_matches_oracle(model.gradient_statistics(x, y, statistics=NORMS_ONLY), expected)


def force_form(monkeypatch: pytest.MonkeyPatch, materialized: bool) -> None:
    """Every LoRA rule takes the materialized form (per-example gradients) or the direct one."""
    for layer_class, (rule,) in list(rules._CONFIGURATIONS.items()):
        forced = dataclasses.replace(rule, materializes=lambda layer, calls: materialized)
        monkeypatch.setitem(rules._CONFIGURATIONS, layer_class, (forced,))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("form", ["direct", "materialized"])
def test_each_form_of_the_rule_is_exact(
    name: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    force_form(monkeypatch, form == "materialized")
    model, x = MODELS[name]()
    y = np.arange(BATCH) % 3
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y), expected)


@pytest.mark.parametrize("form", ["gram", "product"])
def test_the_direct_form_on_sequences_in_both_products(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct form's Gram and product forms of the factors' norms."""
    force_form(monkeypatch, False)
    monkeypatch.setattr(
        rule_math, "gram_has_fewer_products", lambda positions, a, b: form == "gram"
    )
    for name in ("dense_3d", "einsum_heads", "einsum_contracted_last"):
        model, x = MODELS[name]()
        y = np.arange(BATCH) % 3
        expected = oracle_statistics(model, x, y)
        assert_matches_oracle(model.gradient_statistics(x, y), expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_private_step_is_the_clipped_mean(name: str) -> None:
    model, x = MODELS[name]()
    assert_clipped_update(model, x, np.arange(BATCH) % 3)


@pytest.mark.parametrize("name", ["dense_3d", "einsum_heads", "embedding", "dense_shared"])
def test_tracked_step_trains_as_plain_keras(name: str) -> None:
    model, x = MODELS[name]()
    assert_tracked_step_equals_plain(model, x, np.arange(BATCH) % 3)


def test_quantized_layers_stay_on_the_fallback_and_say_so() -> None:
    inputs = keras.Input((5,))
    dense = L.Dense(4)
    features = dense(inputs)
    dense.quantize("int8")
    model = classifier(inputs, features)
    found = rules.lookup(dense)
    assert found.rule is None and "quantized weights (int8)" in found.reason
    assert lora_layer(model).rule is None


def test_a_kernel_trained_again_stays_on_the_fallback() -> None:
    inputs = keras.Input((5,))
    dense = L.Dense(4)
    features = with_lora(dense, inputs, rank=2)
    (kernel,) = [v for v in dense.non_trainable_variables if v.name == "kernel"]
    kernel.trainable = True
    model = classifier(inputs, features)
    assert lora_layer(model).rule is None
