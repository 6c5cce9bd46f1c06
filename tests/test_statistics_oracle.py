"""Every statistic against the per-example-tape oracle, on many models and losses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from layers_without_rule import NoRule
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(7)
Case = tuple[Any, Any, Any, Any]  # model, x, y, sample_weight


def compiled(model: keras.Model, loss: Any, **kwargs: Any) -> keras.Model:
    model.compile(optimizer="sgd", loss=loss, **kwargs)
    return model


def sparse_ce() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp_classifier() -> Case:
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    outputs = keras.layers.Dense(5)(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), sparse_ce())
    return model, rng.normal(size=(24, 12)), rng.integers(0, 5, 24), None


def mlp_regression_sample_weights() -> Case:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(10, activation="sigmoid", use_bias=False)(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), "mse")
    weights = rng.uniform(0.0, 2.0, 20)
    weights[3] = 0.0
    return model, rng.normal(size=(20, 6)), rng.normal(size=(20, 3)), weights


def mlp_sum_reduction() -> Case:
    inputs = keras.Input((7,))
    hidden = keras.layers.Dense(9, activation="elu")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    loss = keras.losses.MeanAbsoluteError(reduction="sum")
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), loss)
    return model, rng.normal(size=(15, 7)), rng.normal(size=(15, 1)), None


def binary_crossentropy_regularized() -> Case:
    # Two regularized variables: with one, a sum of the penalties is the penalty
    # itself, which once hid a sum taken outside the tape.
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(
        8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    outputs = keras.layers.Dense(
        1, activation="sigmoid", bias_regularizer=keras.regularizers.L1(0.02)
    )(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), "binary_crossentropy")
    return model, rng.normal(size=(18, 5)), rng.integers(0, 2, (18, 1)).astype("float32"), None


def dense_on_sequences(steps: int, features: int, units: int) -> Callable[[], Case]:
    def build() -> Case:
        inputs = keras.Input((steps, features))
        hidden = keras.layers.Dense(units, activation="relu")(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        outputs = keras.layers.Dense(4)(pooled)
        model = compiled(kgt.GradientTrackingModel(inputs, outputs), sparse_ce())
        return model, rng.normal(size=(10, steps, features)), rng.integers(0, 4, 10), None

    build.__name__ = f"dense_on_sequences_T{steps}_d{features}_u{units}"
    return build


def dense_on_4d_with_sequence_targets() -> Case:
    inputs = keras.Input((3, 4, 5))
    outputs = keras.layers.Dense(2, activation="tanh")(inputs)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), "mse")
    return (
        model,
        rng.normal(size=(9, 3, 4, 5)),
        rng.normal(size=(9, 3, 4, 2)),
        rng.uniform(size=(9, 3, 4)),
    )


def fallback_layers() -> Case:
    inputs = keras.Input((10, 3))
    hidden = keras.layers.Conv1D(4, 3, strides=2, padding="same", activation="relu")(inputs)
    hidden = NoRule(alpha_initializer="random_uniform")(hidden)
    hidden = keras.layers.Flatten()(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), sparse_ce())
    assert any(tracked.rule is None for tracked in model.gradient_tracking_plan())
    return model, rng.normal(size=(12, 10, 3)), rng.integers(0, 3, 12), None


def embedding_with_repeated_ids() -> Case:
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(5, 4)(inputs)
    hidden = keras.layers.EinsumDense("btd,de->bte", output_shape=(6, 3))(hidden)
    hidden = keras.layers.Flatten()(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), sparse_ce())
    return model, rng.integers(0, 5, (11, 6)), rng.integers(0, 2, 11), None


def shared_dense_called_twice() -> Case:
    left, right = keras.Input((4,)), keras.Input((4,))
    shared = keras.layers.Dense(5, activation="relu")
    merged = keras.layers.Concatenate()([shared(left), shared(right)])
    outputs = keras.layers.Dense(2)(merged)
    model = compiled(kgt.GradientTrackingModel([left, right], outputs), sparse_ce())
    return model, [rng.normal(size=(8, 4)), rng.normal(size=(8, 4))], rng.integers(0, 2, 8), None


class Block(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.inner = keras.layers.Dense(6, activation="relu")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x: Any) -> Any:
        return self.norm(self.inner(x))


class NestedClassifier(kgt.GradientTrackingModel):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = keras.layers.Dense(3)

    def call(self, x: Any) -> Any:
        return self.head(self.block(x))


def nested_subclassed_model() -> Case:
    model = NestedClassifier()
    x = rng.normal(size=(9, 5))
    model(x[:1])
    return compiled(model, sparse_ce()), x, rng.integers(0, 3, 9), None


def multi_input_multi_output() -> Case:
    image, extra = keras.Input((8,), name="image"), keras.Input((3,), name="extra")
    hidden = keras.layers.Dense(7, activation="relu")(image)
    joined = keras.layers.Concatenate()([hidden, extra])
    label = keras.layers.Dense(4, name="label")(joined)
    score = keras.layers.Dense(1, name="score")(joined)
    model = kgt.GradientTrackingModel([image, extra], {"label": label, "score": score})
    model = compiled(
        model,
        {"label": sparse_ce(), "score": "mse"},
        loss_weights={"label": 1.0, "score": 0.5},
    )
    x = {"image": rng.normal(size=(10, 8)), "extra": rng.normal(size=(10, 3))}
    y = {"label": rng.integers(0, 4, 10), "score": rng.normal(size=(10, 1))}
    return model, x, y, None


def sequence_regression() -> Case:
    """A loss per position and no sample weights: `l_i` is the mean over positions."""
    inputs = keras.Input((7, 5))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), "mse")
    return model, rng.normal(size=(9, 7, 5)), rng.normal(size=(9, 7, 3)), None


def unrolled_recurrent_layers() -> Case:
    """Unrolled Bidirectional LSTM and GRU: the recurrent rule over Keras' unrolled loop,
    the same rule as over its `tf.while_loop` (tests/test_recurrent.py has the rest)."""
    inputs = keras.Input((4, 3))
    hidden = keras.layers.Bidirectional(keras.layers.LSTM(3, unroll=True))(inputs)
    sequence = keras.layers.GRU(2, return_sequences=True, unroll=True)(inputs)
    merged = keras.layers.Concatenate()([hidden, keras.layers.Flatten()(sequence)])
    outputs = keras.layers.Dense(2)(merged)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs), sparse_ce())
    return model, rng.normal(size=(7, 4, 3)), rng.integers(0, 2, 7), None


def sequential_model() -> Case:
    model = kgt.GradientTrackingSequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(2)]
    )
    return compiled(model, sparse_ce()), rng.normal(size=(7, 4)), rng.integers(0, 2, 7), None


CASES = [
    mlp_classifier,
    mlp_regression_sample_weights,
    mlp_sum_reduction,
    binary_crossentropy_regularized,
    dense_on_sequences(3, 16, 32),  # T (d_in + d_out) < d_in d_out: Gram form
    dense_on_sequences(40, 4, 5),  # materializes A_i^T D_i
    dense_on_4d_with_sequence_targets,
    fallback_layers,
    embedding_with_repeated_ids,
    shared_dense_called_twice,
    nested_subclassed_model,
    multi_input_multi_output,
    sequential_model,
    sequence_regression,
    unrolled_recurrent_layers,
]


@pytest.mark.parametrize("build", CASES, ids=lambda build: build.__name__)
def test_every_statistic_matches_the_per_example_oracle(build: Callable[[], Case]) -> None:
    model, x, y, sample_weight = build()
    expected = oracle_statistics(model, x, y, sample_weight)
    stats = model.gradient_statistics(x, y, sample_weight)
    assert stats["layer_grad_norm"].shape == (
        len(expected["grad_norm"]),
        len(model.tracked_layer_names),
    )
    assert_matches_oracle(stats, expected)


def test_the_oracle_comparison_catches_a_wrong_value() -> None:
    model, x, y, _ = mlp_classifier()
    expected = oracle_statistics(model, x, y)
    stats = model.gradient_statistics(x, y)
    stats["grad_norm"] = stats["grad_norm"] * (1 + 2e-4)
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_matches_oracle(stats, expected)


@pytest.mark.parametrize(
    "build",
    [mlp_classifier, dense_on_sequences(40, 4, 5), fallback_layers, shared_dense_called_twice],
    ids=lambda build: build.__name__,
)
def test_opt_in_pairwise_cosine_matches_the_oracle(build: Callable[[], Case]) -> None:
    model, x, y, sample_weight = build()
    expected = oracle_statistics(model, x, y, sample_weight)
    stats = model.gradient_statistics(x, y, sample_weight, statistics=["pairwise_cosine", "cosine"])
    assert stats["pairwise_cosine"].shape == (len(expected["loss"]),) * 2
    assert_matches_oracle(stats, expected)


def test_pairwise_cosine_is_never_computed_by_default() -> None:
    model, x, y, _ = mlp_classifier()
    assert "pairwise_cosine" not in model.gradient_statistics(x, y)


@pytest.mark.parametrize(
    "build",
    [mlp_regression_sample_weights, dense_on_4d_with_sequence_targets, multi_input_multi_output],
    ids=lambda build: build.__name__,
)
def test_opt_in_input_grad_norm_matches_the_oracle(build: Callable[[], Case]) -> None:
    model, x, y, sample_weight = build()
    expected = oracle_statistics(model, x, y, sample_weight)
    stats = model.gradient_statistics(x, y, sample_weight, statistics=["input_grad_norm", "loss"])
    assert_matches_oracle(stats, expected)


def test_input_grad_norm_is_refused_for_integer_inputs() -> None:
    model, x, y, _ = embedding_with_repeated_ids()
    with pytest.raises(ValueError, match="needs float inputs"):
        model.gradient_statistics(x, y, statistics=["input_grad_norm"])


def test_derived_values_are_computed_once_per_step() -> None:
    # Cosine, mean_cosine and frac_negative_cosine all read the cosine: one computation.
    primitives = kgt.statistics.StepPrimitives(
        loss=np.ones(4, np.float32),
        sq_norm=np.full((4, 2), 2.0, np.float32),
        dot=np.ones((4, 2), np.float32),
        reference_sq_norm=np.ones(2, np.float32),
        sum_sq_norm=np.ones(2, np.float32),
        batch_size=np.float32(4.0),
    )
    for name in ("grad_sq_norm", "grad_norm", "reference_norm", "cosine"):
        assert getattr(primitives, name) is getattr(primitives, name), name
    np.testing.assert_allclose(primitives.cosine, np.full(4, 2 / (2 * np.sqrt(2))), rtol=1e-6)
