"""The PyTorch engine against the plain oracle: one `torch.autograd.grad` per example.

Every default statistic (and `pairwise_cosine`) of a tracked `fit` step, on models that
cover every rule the engine runs and its fallback, with sample weights, weight penalties,
a summed loss and a regression loss; each layer's path is the one expected (rules, not
the fallback, wherever a rule exists).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import torch
from backend_models import MODELS, ChannelScale, compiled, head
from backend_oracle import tracked_statistics
from torch_oracle import CountedProducts, assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.backends.torch.plan import FALLBACK_PATH

BATCH = 6
NAMES = [
    "loss",
    "grad_norm",
    "cosine",
    "layer_grad_norm",
    "layer_cosine",
    "batch_grad_norm",
    "gradient_diversity",
    "noise_scale",
    "mean_cosine",
    "frac_negative_cosine",
]


def embedding_sequence(model_class: type) -> Any:
    """Token ids through an Embedding (repeated ids in an example), a Dense on every
    position and an EinsumDense."""
    inputs = keras.Input((7,), dtype="int32")
    hidden = keras.layers.Embedding(5, 4)(inputs)
    hidden = keras.layers.Dense(6, activation="gelu")(hidden)
    hidden = keras.layers.EinsumDense("btd,dk->btk", output_shape=(None, 3), bias_axes="k")(hidden)
    return head(model_class, inputs, keras.layers.GlobalAveragePooling1D()(hidden))


def transposed_and_prelu(model_class: type) -> Any:
    inputs = keras.Input((5, 5, 2))
    hidden = keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same")(inputs)
    hidden = keras.layers.PReLU(shared_axes=[1, 2])(hidden)
    hidden = keras.layers.Conv1D(2, 2)(keras.layers.Reshape((10, 30))(hidden))
    return head(model_class, inputs, hidden)


def without_rule(model_class: type) -> Any:
    """A layer of one's own (no rule): the fallback, beside rules."""
    inputs = keras.Input((4, 6))
    hidden = ChannelScale()(inputs)
    hidden = keras.layers.Dense(5, activation="tanh")(hidden)
    return head(model_class, inputs, hidden)


def penalized(model_class: type) -> Any:
    """Weight penalties: `G` holds them, the examples' gradients do not."""
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")(inputs)
    return head(model_class, inputs, hidden)


def lora(model_class: type) -> Any:
    """A Dense with LoRA (only its factors train)."""
    inputs = keras.Input((12,))
    dense = keras.layers.Dense(8, activation="relu")
    hidden = dense(inputs)
    dense.enable_lora(2)
    return head(model_class, inputs, hidden)


BUILDERS: dict[str, tuple[Callable[[type], Any], tuple[int, ...]]] = {
    **MODELS,
    "embedding_sequence": (embedding_sequence, (7,)),
    "transposed_and_prelu": (transposed_and_prelu, (5, 5, 2)),
    "without_rule": (without_rule, (4, 6)),
    "penalized": (penalized, (12,)),
    "lora": (lora, (12,)),
}


def data(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    _, shape = BUILDERS[name]
    rng = np.random.default_rng(seed)
    if name == "embedding_sequence":
        x = rng.integers(0, 5, (BATCH, *shape)).astype("int32")
    else:
        x = rng.normal(size=(BATCH, *shape)).astype("float32")
    return x, rng.integers(0, 3, BATCH)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_statistic_matches_the_oracle(name: str) -> None:
    model = compiled(BUILDERS[name][0](kgt.GradientTrackingModel))
    x, y = data(name)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    got = tracked_statistics(model, x, y, names=[*NAMES, "pairwise_cosine"])
    assert_matches_oracle(got, expected)


def test_sample_weights_a_summed_loss_and_mse() -> None:
    x, y = data("mlp", seed=2)
    weights = np.linspace(0.0, 2.0, BATCH).astype("float32")
    for loss in (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ):
        model = MODELS["mlp"][0](kgt.GradientTrackingModel)
        model.compile(optimizer="sgd", loss=loss)
        model(x[:1])
        expected = oracle_statistics(model, x, y, weights)
        assert_matches_oracle(tracked_statistics(model, x, y, weights, names=NAMES), expected)
    model = MODELS["mlp"][0](kgt.GradientTrackingModel)
    model.compile(optimizer="sgd", loss="mse")
    targets = np.random.default_rng(3).normal(size=(BATCH, 3)).astype("float32")
    model(x[:1])
    expected = oracle_statistics(model, x, targets)
    assert_matches_oracle(tracked_statistics(model, x, targets, names=NAMES), expected)


def test_gradient_statistics_matches_the_oracle_and_changes_nothing() -> None:
    model = compiled(BUILDERS["transformer_block"][0](kgt.GradientTrackingModel))
    x, y = data("transformer_block", seed=4)
    model(x[:1])
    before = [np.array(w) for w in model.get_weights()]
    expected = oracle_statistics(model, x, y)
    got = model.gradient_statistics(x, y, statistics=NAMES)
    assert_matches_oracle(got, expected)
    assert int(got["batch_size"]) == BATCH
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_every_layer_with_a_rule_runs_on_it() -> None:
    paths = {}
    for build, _ in BUILDERS.values():
        model = build(kgt.GradientTrackingModel)
        for tracked in model.gradient_tracking_plan():
            paths[type(tracked.layer).__name__] = tracked.path
    assert paths.pop("ChannelScale") == FALLBACK_PATH
    assert all(path.startswith("rule:") for path in paths.values()), paths
    assert paths["Dense"] == "rule:lora_dense" or paths["Dense"] == "rule:dense"


# The statistics that read no product with the batch gradient (`Statistic.needs_dot`).
NORMS = ["loss", "grad_norm", "layer_grad_norm", "gradient_diversity", "batch_grad_norm"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_norm_only_statistics_match_the_oracle(name: str) -> None:
    model = compiled(BUILDERS[name][0](kgt.GradientTrackingModel))
    x, y = data(name, seed=5)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    got = tracked_statistics(model, x, y, names=NORMS)
    assert_matches_oracle(got, {name: expected[name] for name in NORMS})


@pytest.mark.parametrize("name", ["mlp", "embedding_sequence", "cnn"])
def test_norm_only_step_forms_no_product_with_the_batch_gradient(name: str) -> None:
    """Eager torch runs what it is given: a step whose statistics read no `<g_i, G>`
    forms none (on the MLP no product at all beyond its forward and backward pass's)."""
    model = compiled(BUILDERS[name][0](kgt.GradientTrackingModel))
    x, y = data(name)
    model(x[:1])

    def products(names: list[str]) -> int:
        model.gradient_statistics(x, y, statistics=names)  # the plan and its searches
        with CountedProducts() as counted:
            model.gradient_statistics(x, y, statistics=names)
        return counted.count

    norms, cosine = products(NORMS), products([*NORMS, "cosine"])
    assert norms < cosine, (norms, cosine)
    if name == "mlp":
        with CountedProducts() as counted:
            loss = model.compute_loss(x=x, y=torch.as_tensor(y), y_pred=model(x))
            torch.autograd.grad(loss, [v.value for v in model.trainable_variables])
        assert norms == counted.count, (norms, counted.count)
