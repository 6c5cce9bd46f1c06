"""Norm-only statistics: exact, and the step computes no product with the batch gradient."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

layers = keras.layers
rng = np.random.default_rng(17)
NORMS = ["loss", "grad_norm", "layer_grad_norm", "gradient_diversity", "batch_grad_norm"]
# Ops that multiply by a weight-sized tensor: the products a step's cost is made of.
PRODUCTS = {"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv2DBackpropFilter"}


def mlp() -> tuple[Any, Any, Any]:
    inputs = keras.Input((12,))
    hidden = layers.Dense(16, activation="relu")(inputs)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3)(hidden))
    return model, rng.normal(size=(8, 12)).astype("float32"), rng.integers(0, 3, 8)


def text() -> tuple[Any, Any, Any]:
    inputs = keras.Input((6,), dtype="int32")
    hidden = layers.Embedding(20, 8)(inputs)
    hidden = layers.Dense(8, activation="relu")(hidden)
    hidden = layers.LayerNormalization()(hidden)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=4)(hidden, hidden)
    outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(attended))
    model = kgt.GradientTrackingModel(inputs, outputs)
    return model, rng.integers(0, 20, (8, 6)), rng.integers(0, 3, 8)


def cnn() -> tuple[Any, Any, Any]:
    inputs = keras.Input((8, 8, 3))
    hidden = layers.Conv2D(4, 3, activation="relu")(inputs)
    hidden = layers.DepthwiseConv2D(3)(hidden)
    outputs = layers.Dense(3)(layers.Flatten()(hidden))
    model = kgt.GradientTrackingModel(inputs, outputs)
    return model, rng.normal(size=(8, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 8)


def recurrent() -> tuple[Any, Any, Any]:
    inputs = keras.Input((5, 4))
    outputs = layers.Dense(3)(layers.LSTM(6)(inputs))
    model = kgt.GradientTrackingModel(inputs, outputs)
    return model, rng.normal(size=(8, 5, 4)).astype("float32"), rng.integers(0, 3, 8)


MODELS: dict[str, Callable[[], tuple[Any, Any, Any]]] = {
    "mlp": mlp,
    "text": text,
    "cnn": cnn,
    "recurrent": recurrent,
}


def compiled(model: Any) -> Any:
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_norm_only_statistics_match_the_oracle(name: str) -> None:
    keras.utils.set_random_seed(4)
    model, x, y = MODELS[name]()
    compiled(model)
    stats = model.gradient_statistics(x, y, statistics=NORMS)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle({k: v for k, v in stats.items() if k in NORMS}, expected)


def traced_ops(model: Any, x: Any, y: Any, statistics: Any) -> list[str]:
    """The op types of the traced step (tracked with `statistics`, or plain: None),
    its functions' included."""
    resolved = None if statistics is None else kgt.statistics.resolve(statistics)

    def step(x: tf.Tensor, y: tf.Tensor) -> Any:
        if resolved is None:
            return model._untracked_step((x, y))
        return model._tracked_step((x, y), resolved)

    specs = [tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)) for x in (x, y)]
    graph = tf.function(step).get_concrete_function(*specs).graph
    found = [op.type for op in graph.get_operations()]
    for function in graph.as_graph_def().library.function:
        found += [node.op for node in function.node_def]
    return found


def product_ops(model: Any, x: Any, y: Any, statistics: Any) -> list[str]:
    """The product ops of the traced step (tracked with `statistics`, or plain: None)."""
    return sorted(op for op in traced_ops(model, x, y, statistics) if op in PRODUCTS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_norm_only_step_computes_no_product_with_the_batch_gradient(name: str) -> None:
    keras.utils.set_random_seed(4)
    model, x, y = MODELS[name]()
    compiled(model).fit(x, y, verbose=0)  # builds the optimizer
    norms = product_ops(model, x, y, NORMS)
    default = product_ops(model, x, y, ["loss", "cosine"])
    # The cosine's dots are products with the batch gradient; the norms need none.
    assert len(norms) < len(default), (norms, default)
    if name == "mlp":
        # On 2-D inputs a Dense layer's norms are `||a_i||^2 ||d_i||^2`: no product
        # at all beyond the plain step's.
        assert norms == product_ops(model, x, y, None)


# Ops (constants aside) the MLP's norm-only step adds to its plain step when traced: 51
# (87 before the layers' columns were scaled together and each derived value was
# computed once, 71 before a Dense layer's one call on 2-D inputs was read as it is,
# without reshapes to sequences). A step that adds a pass over the layers, or one op
# per layer where one for all layers does, goes past the bound.
NORM_ONLY_EXTRA_OPS = 56


def test_norm_only_step_adds_few_ops_to_the_plain_step() -> None:
    keras.utils.set_random_seed(4)
    model, x, y = mlp()
    compiled(model).fit(x, y, verbose=0)  # builds the optimizer

    def counted(statistics: Any) -> collections.Counter[str]:
        return collections.Counter(
            op for op in traced_ops(model, x, y, statistics) if op != "Const"
        )

    plain = counted(None)
    norms = counted(["loss", "grad_norm", "layer_grad_norm"])
    extra = norms.total() - plain.total()
    assert extra <= NORM_ONLY_EXTRA_OPS, (extra, dict((norms - plain).most_common()))


def test_a_user_statistic_gets_dots_unless_it_says_otherwise() -> None:
    class SumOfDots(kgt.statistics.Statistic):
        name = "sum_of_dots"

        def compute(self, primitives: Any) -> tf.Tensor:
            return tf.reduce_sum(primitives.dot, axis=1)

    model, x, y = mlp()
    compiled(model)
    stats = model.gradient_statistics(
        x, y, statistics=["grad_norm", "batch_grad_norm", SumOfDots()]
    )
    cosine = stats["sum_of_dots"] / (stats["grad_norm"] * stats["batch_grad_norm"])
    np.testing.assert_allclose(cosine, oracle_statistics(model, x, y)["cosine"], rtol=1e-4)
