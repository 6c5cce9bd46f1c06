"""Every layer in the JAX engine's scope, and three models, against the `jax.grad` oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS, ChannelScale, compiled
from backend_oracle import tracked_statistics
from jax_oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack import rule_math
from keras_gradtrack.backends.ops import rules as ops_rules

BATCH = 6
rng = np.random.default_rng(0)


def floats(*shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype("float32")


def classifier(inputs: Any, features: Any, classes: int = 3) -> Any:
    if len(features.shape) > 2:
        features = keras.layers.Flatten()(features)
    outputs = keras.layers.Dense(classes, name="head")(features)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def labels(classes: int = 3) -> np.ndarray:
    return rng.integers(0, classes, BATCH)


def image_layer(layer: Callable[[], Any], shape: tuple[int, ...]) -> Any:
    def build() -> tuple[Any, np.ndarray]:
        inputs = keras.Input(shape)
        return classifier(inputs, layer()(inputs)), floats(BATCH, *shape)

    return build


def token_model() -> tuple[Any, np.ndarray]:
    inputs = keras.Input((5,), dtype="int32")
    features = keras.layers.Embedding(7, 4)(inputs)
    ids = rng.integers(0, 7, (BATCH, 5)).astype("int32")
    ids[:, 1] = ids[:, 0]  # repeated ids in every example
    return classifier(inputs, features), ids


def shared_dense() -> tuple[Any, np.ndarray]:
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh")
    return classifier(inputs, shared(shared(inputs))), floats(BATCH, 4)


def lora_dense() -> tuple[Any, np.ndarray]:
    # LoRA: the kernel is frozen (non-trainable), two low-rank factors train, scaled by
    # lora_alpha / rank = 1.5. Not a tanh after a second factor of ones: that saturated
    # (1 - h^2 down to 3e-6), and float32 left the layer's gradients, the oracle's
    # too, up to 1.6e-4 from their float64 values. Here both agree with float64 to
    # within 2% of the tolerance (40 seeds).
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(5)
    features = dense(inputs)
    dense.enable_lora(2, lora_alpha=3, b_initializer=keras.initializers.RandomNormal(stddev=0.2))
    return classifier(inputs, features), floats(BATCH, 4)


LAYERS = {
    "lora_dense": lora_dense,
    "dense": image_layer(lambda: keras.layers.Dense(5, activation="relu"), (4,)),
    "dense_sequence": image_layer(lambda: keras.layers.Dense(5, activation="tanh"), (3, 4)),
    "dense_long_sequence": image_layer(lambda: keras.layers.Dense(2), (9, 3)),
    "einsum_dense": image_layer(
        lambda: keras.layers.EinsumDense("abc,cde->abde", (3, 2, 2), bias_axes="de"), (3, 4)
    ),
    "einsum_dense_activation": image_layer(
        lambda: keras.layers.EinsumDense("ab,bc->ac", (5,), bias_axes="c", activation="relu"),
        (4,),
    ),
    "embedding": token_model,
    "conv1d": image_layer(lambda: keras.layers.Conv1D(3, 2, strides=2, padding="same"), (7, 2)),
    "conv2d": image_layer(
        lambda: keras.layers.Conv2D(3, 3, dilation_rate=2, activation="relu"), (7, 7, 2)
    ),
    "depthwise_conv2d": image_layer(lambda: keras.layers.DepthwiseConv2D(3), (5, 5, 2)),
    "separable_conv2d": image_layer(lambda: keras.layers.SeparableConv2D(3, 2), (5, 5, 2)),
    "layer_normalization": image_layer(lambda: keras.layers.LayerNormalization(), (3, 4)),
    "rms_normalization": image_layer(lambda: keras.layers.RMSNormalization(), (3, 4)),
    "group_normalization": image_layer(lambda: keras.layers.GroupNormalization(2), (3, 4)),
    "shared_dense": shared_dense,
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_the_oracle(name: str) -> None:
    model, x = LAYERS[name]()
    y = labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_frozen_batch_normalization_is_not_tracked_and_the_rest_is_exact() -> None:
    inputs = keras.Input((4,))
    normalization = keras.layers.BatchNormalization()
    features = normalization(keras.layers.Dense(5)(inputs))
    normalization.trainable = False
    model = classifier(inputs, features)
    x, y = floats(BATCH, 4), labels()
    assert len(model.tracked_layer_names) == 2
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_sample_weights_and_sum_reduction() -> None:
    inputs = keras.Input((4,))
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    x, y, weights = floats(BATCH, 4), floats(BATCH, 2), rng.uniform(size=BATCH).astype("float32")
    expected = oracle_statistics(model, x, y, weights)
    assert_matches_oracle(tracked_statistics(model, x, y, weights), expected)


def test_sequence_dense_in_the_gram_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # Per-example gradients too large to hold: the Gram form `<A_i A_i^T, D_i D_i^T>`.
    monkeypatch.setattr(ops_rules, "MATERIALIZED_VALUES", 0)
    model, x = LAYERS["dense_sequence"]()
    y = labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


@pytest.mark.parametrize("steps", [3, 48])
def test_sequence_dense_over_budget_takes_the_form_that_holds_fewer_values(
    steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per-example gradients over the budget: the Gram form at 3 positions (2 * 3^2 < 4 * 5
    # values per example), materialized at 48 (its (48, 48) Gram matrices would hold more
    # than the 4 x 5 kernel gradient), and exact either way.
    monkeypatch.setattr(ops_rules, "MATERIALIZED_VALUES", 0)
    gram_calls = []
    gram_sq_norms = rule_math.gram_sq_norms

    def counted(a: Any, d: Any) -> Any:
        gram_calls.append(a.shape)
        return gram_sq_norms(a, d)

    monkeypatch.setattr(rule_math, "gram_sq_norms", counted)
    model, x = image_layer(lambda: keras.layers.Dense(5, activation="tanh"), (steps, 4))()
    y = labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
    assert bool(gram_calls) == (steps == 3), gram_calls


def test_embedding_past_the_gram_form_s_length_sorts_and_sums_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 40 tokens from 7 ids: many repeats per example, and no (B, 40, 40) Gram matrix.
    def no_gram(ids: Any, d: Any) -> Any:
        raise AssertionError(f"the token Gram form at {ids.shape[1]} tokens")

    monkeypatch.setattr(rule_math, "token_gram_sq_norms", no_gram)
    inputs = keras.Input((40,), dtype="int32")
    model = classifier(inputs, keras.layers.Embedding(7, 4)(inputs))
    x = rng.integers(0, 7, (BATCH, 40)).astype("int32")
    y = labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_weight_penalties_are_in_the_batch_gradient_not_in_the_examples() -> None:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, kernel_regularizer=keras.regularizers.L2(0.1))(inputs)
    model = classifier(inputs, hidden)
    x, y = floats(BATCH, 4), labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


# The statistics that read no product with the batch gradient (`Statistic.needs_dot`):
# the rules' norm-only forms (`dot` None).
NORMS = ["loss", "grad_norm", "layer_grad_norm", "gradient_diversity", "batch_grad_norm"]


@pytest.mark.parametrize(
    "name", ["dense", "dense_long_sequence", "embedding", "conv2d", "lora_dense", "shared_dense"]
)
def test_norm_only_statistics_match_the_oracle(name: str) -> None:
    model, x = LAYERS[name]()
    y = labels()
    expected = oracle_statistics(model, x, y)
    got = tracked_statistics(model, x, y, names=NORMS)
    assert_matches_oracle(got, {name: expected[name] for name in NORMS})


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_the_oracle(name: str) -> None:
    build, shape = MODELS[name]
    model = compiled(build(kgt.GradientTrackingModel))
    x, y = floats(BATCH, *shape), labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_gradient_statistics_match_the_oracle_and_change_no_weight() -> None:
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    x, y = floats(BATCH, 12), labels()
    ids = np.arange(BATCH, dtype=np.int64) + 2**40
    before = model.get_weights()
    expected = oracle_statistics(model, x, y)
    stats = model.gradient_statistics({"x": x, "example_id": ids}, y)
    assert_matches_oracle(stats, expected)
    np.testing.assert_array_equal(stats["example_id"], ids)
    assert int(stats["batch_size"]) == BATCH
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_the_summary_names_each_layers_path() -> None:
    model = compiled(MODELS["transformer_block"][0](kgt.GradientTrackingModel))
    text = model.gradient_tracking_summary(print_fn=lambda _: None)
    for path in ("rule:einsum_dense", "rule:dense", "rule:layer_normalization"):
        assert path in text
    assert "fallback" not in text
    assert len(text.splitlines()) == 2 + len(model.tracked_layer_names)


def test_the_summary_names_the_fallback_of_a_layer_without_a_rule() -> None:
    inputs = keras.Input((4,))
    model = classifier(inputs, ChannelScale()(inputs))
    text = model.gradient_tracking_summary(print_fn=lambda _: None)
    assert "fallback" in text.splitlines()[2] and "rule:dense" in text.splitlines()[3]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_layer_of_the_models_is_on_the_fallback(name: str) -> None:
    model = compiled(MODELS[name][0](kgt.GradientTrackingModel))
    paths = {t.name: t.path for t in model.gradient_tracking_plan()}
    assert all(path.startswith("rule:") for path in paths.values()), paths


class Subclassed(kgt.GradientTrackingMixin, keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):  # type: ignore[no-untyped-def]
        return self.out(self.hidden(x))


@pytest.mark.parametrize("style", ["sequential", "subclassed"])
def test_sequential_and_subclassed_models_match_the_oracle(style: str) -> None:
    if style == "sequential":
        model = kgt.GradientTrackingSequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        )
    else:
        model = Subclassed()
        model(floats(1, 4))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = floats(BATCH, 4), labels()
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
