"""The Embedding, normalization and EinsumDense rules against the per-example oracle.

Every case also asserts which path the plan reports for the layers under test,
so a rule that silently stops applying (and leaves the work to the fallback)
fails here rather than only getting slower.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.engine.tracked_layer import FALLBACK_PATH
from keras_gradtrack.rules.einsum import einsum_roles
from keras_gradtrack.rules.ops import GRAM_MAX_TOKENS

rng = np.random.default_rng(11)
BATCH = 6

# model, x, y, expected path per layer class
Case = tuple[keras.Model, Any, Any, dict[type, str]]

EMBEDDING = {keras.layers.Embedding: "rule:embedding"}
LAYER_NORM = {keras.layers.LayerNormalization: "rule:layer_normalization"}
GROUP_NORM = {keras.layers.GroupNormalization: "rule:group_normalization"}
RMS_NORM = {keras.layers.RMSNormalization: "rule:rms_normalization"}
EINSUM = {keras.layers.EinsumDense: "rule:einsum_dense"}


def classifier(inputs: Any, hidden: Any, classes: int = 3) -> keras.Model:
    if len(hidden.shape) > 2:
        hidden = keras.layers.Flatten()(hidden)
    outputs = keras.layers.Dense(classes)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def labels(classes: int = 3) -> np.ndarray:
    return rng.integers(0, classes, BATCH)


def case(name: str) -> Callable[[Callable[[], Case]], Callable[[], Case]]:
    """Names a case's builder; the builder draws its data from a generator seeded by
    that name, so a case's data do not depend on which cases ran before it."""

    def named(build: Callable[[], Case]) -> Callable[[], Case]:
        def seeded_build() -> Case:
            global rng
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            return build()

        seeded_build.__name__ = name
        return seeded_build

    return named


# -- Embedding ---------------------------------------------------------------


def embedding_case(
    name: str,
    input_shape: tuple[int, ...],
    vocabulary: int,
    low: int = 0,
    mask_zero: bool = False,
    float_ids: bool = False,
) -> Callable[[], Case]:
    @case(name)
    def build() -> Case:
        inputs = keras.Input(input_shape, dtype="float32" if float_ids else "int32")
        hidden = keras.layers.Embedding(vocabulary, 4, mask_zero=mask_zero)(inputs)
        if mask_zero:
            hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        ids = rng.integers(low, vocabulary, (BATCH, *input_shape))
        if mask_zero:
            ids[:, -2:] = 0
        ids = ids.astype("float32" if float_ids else "int32")
        return classifier(inputs, hidden), ids, labels(), EMBEDDING

    return build


@case("embedding_long_sequence_segment_sums")
def embedding_long_sequence() -> Case:
    steps = GRAM_MAX_TOKENS + 8
    inputs = keras.Input((steps,), dtype="int32")
    hidden = keras.layers.Embedding(9, 3)(inputs)
    hidden = keras.layers.Dense(2, activation="tanh")(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return classifier(inputs, hidden), rng.integers(0, 9, (BATCH, steps)), labels(), EMBEDDING


# -- normalization -----------------------------------------------------------


def normalization_case(
    name: str, input_shape: tuple[int, ...], make_layer: Callable[[], Any], paths: dict[type, str]
) -> Callable[[], Case]:
    @case(name)
    def build() -> Case:
        inputs = keras.Input(input_shape)
        # A Dense layer in front gives the normalization an input that depends
        # on the weights, and a non-trivial gamma/beta after one step of noise.
        hidden = keras.layers.Dense(input_shape[-1], activation="tanh")(inputs)
        layer = make_layer()
        hidden = layer(hidden)
        model = classifier(inputs, hidden)
        for variable in layer.trainable_variables:
            variable.assign(rng.normal(1.0, 0.3, variable.shape))
        return model, rng.normal(size=(BATCH, *input_shape)), labels(), paths

    return build


# -- EinsumDense ---------------------------------------------------------------


def einsum_case(
    name: str,
    equation: str,
    input_shape: tuple[int, ...],
    output_shape: Any,
    bias_axes: str | None = None,
    activation: str | None = None,
) -> Callable[[], Case]:
    @case(name)
    def build() -> Case:
        inputs = keras.Input(input_shape)
        layer = keras.layers.EinsumDense(
            equation, output_shape, bias_axes=bias_axes, activation=activation
        )
        hidden = layer(inputs)
        model = classifier(inputs, hidden)
        if layer.bias is not None:
            layer.bias.assign(rng.normal(size=layer.bias.shape))
        return model, rng.normal(size=(BATCH, *input_shape)), labels(), EINSUM

    return build


@case("multi_head_self_attention")
def multi_head_self_attention() -> Case:
    inputs = keras.Input((5, 8))
    hidden = keras.layers.MultiHeadAttention(2, 4, dropout=0.0)(inputs, inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return classifier(inputs, hidden), rng.normal(size=(BATCH, 5, 8)), labels(), EINSUM


@case("multi_head_cross_attention_2d_attention_axes")
def multi_head_cross_attention() -> Case:
    query, value = keras.Input((3, 2, 4)), keras.Input((4, 2, 5))
    attention = keras.layers.MultiHeadAttention(2, 3, value_dim=2, attention_axes=(1,))
    hidden = attention(query, value)
    x = [rng.normal(size=(BATCH, 3, 2, 4)), rng.normal(size=(BATCH, 4, 2, 5))]
    return classifier([query, value], hidden), x, labels(), EINSUM


# -- shared layers and a Transformer block ---------------------------------------


@case("shared_embedding_layer_normalization_einsum")
def shared_layers() -> Case:
    short, long = keras.Input((4,), dtype="int32"), keras.Input((7,), dtype="int32")
    embedding = keras.layers.Embedding(6, 5)
    norm = keras.layers.LayerNormalization()
    projection = keras.layers.EinsumDense("abc,cd->abd", (None, 3), bias_axes="d")
    pooled = [
        keras.layers.GlobalAveragePooling1D()(projection(norm(embedding(ids))))
        for ids in (short, long)
    ]
    hidden = keras.layers.Concatenate()(pooled)
    x = [rng.integers(0, 6, (BATCH, 4)), rng.integers(0, 6, (BATCH, 7))]
    return (
        classifier([short, long], hidden),
        x,
        labels(),
        {**EMBEDDING, **LAYER_NORM, **EINSUM},
    )


@case("frozen_kernel_and_gamma")
def frozen_kernel_and_gamma() -> Case:
    inputs = keras.Input((4, 3))
    projection = keras.layers.EinsumDense("abc,cd->abd", (4, 5), bias_axes="d")
    norm = keras.layers.LayerNormalization()
    model = classifier(inputs, norm(projection(inputs)))
    projection.kernel.trainable = False
    norm.gamma.trainable = False
    paths = {**LAYER_NORM, **EINSUM}
    return model, rng.normal(size=(BATCH, 4, 3)), labels(), paths


@case("transformer_block")
def transformer_block() -> Case:
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(20, 16, mask_zero=True)(inputs)
    attended = keras.layers.MultiHeadAttention(2, 8, dropout=0.0)(x, x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
    feed_forward = keras.layers.Dense(32, activation="relu")(x)
    feed_forward = keras.layers.Dense(16)(feed_forward)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, feed_forward]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    ids = rng.integers(1, 20, (BATCH, 8))
    ids[:, 6:] = 0
    paths = {**EMBEDDING, **LAYER_NORM, **EINSUM}
    return classifier(inputs, x), ids, labels(), paths


@case("group_norm_4d_far_from_zero")
def group_norm_far_from_zero() -> Case:
    """Inputs whose mean is many standard deviations from zero: the rule sums `d * x`
    and subtracts `mean * sum(d)`, the order Keras' own gradient of gamma takes."""
    inputs = keras.Input((3, 3, 4))
    hidden = keras.layers.Dense(4, bias_initializer=keras.initializers.Constant(30.0))(inputs)
    layer = keras.layers.GroupNormalization(groups=2)
    hidden = layer(hidden)
    model = classifier(inputs, hidden)
    for variable in layer.trainable_variables:
        variable.assign(rng.normal(1.0, 0.3, variable.shape))
    return model, rng.normal(size=(BATCH, 3, 3, 4)), labels(), GROUP_NORM


def layer_norm(**kwargs: Any) -> Callable[[], Any]:
    return lambda: keras.layers.LayerNormalization(**kwargs)


def group_norm(**kwargs: Any) -> Callable[[], Any]:
    return lambda: keras.layers.GroupNormalization(**kwargs)


def rms_norm(**kwargs: Any) -> Callable[[], Any]:
    return lambda: keras.layers.RMSNormalization(**kwargs)


CASES = [
    embedding_case("embedding_2d_repeated_ids", (7,), vocabulary=4),
    embedding_case("embedding_mask_zero", (6,), vocabulary=5, mask_zero=True),
    embedding_case("embedding_3d_ids", (3, 4), vocabulary=5),
    embedding_case("embedding_one_id_per_example", (), vocabulary=3),
    embedding_case("embedding_negative_and_float_ids", (5,), vocabulary=4, low=-4, float_ids=True),
    embedding_long_sequence,
    normalization_case("layer_norm_2d", (6,), layer_norm(), LAYER_NORM),
    normalization_case("layer_norm_3d_last_axis", (4, 5), layer_norm(), LAYER_NORM),
    normalization_case("layer_norm_3d_axis_1", (4, 5), layer_norm(axis=1), LAYER_NORM),
    normalization_case("layer_norm_4d_two_axes", (3, 2, 4), layer_norm(axis=[1, 3]), LAYER_NORM),
    normalization_case("layer_norm_no_center", (4, 5), layer_norm(center=False), LAYER_NORM),
    normalization_case("layer_norm_no_scale", (4, 5), layer_norm(scale=False), LAYER_NORM),
    pytest.param(
        normalization_case(
            "layer_norm_rms_scaling", (4, 5), layer_norm(rms_scaling=True), LAYER_NORM
        ),
        marks=pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning"),
    ),
    normalization_case("group_norm_3d", (5, 6), group_norm(groups=2), GROUP_NORM),
    normalization_case("group_norm_4d_instance", (3, 3, 4), group_norm(groups=-1), GROUP_NORM),
    normalization_case(
        "group_norm_channels_first_no_center",
        (4, 3, 2),
        group_norm(groups=2, axis=1, center=False),
        GROUP_NORM,
    ),
    group_norm_far_from_zero,
    normalization_case("rms_norm_2d", (6,), rms_norm(), RMS_NORM),
    normalization_case("rms_norm_3d_two_axes", (4, 5), rms_norm(axis=[-2, -1]), RMS_NORM),
    normalization_case(
        "rms_norm_leading_axis_falls_back",
        (5, 5),
        rms_norm(axis=1),
        {keras.layers.RMSNormalization: FALLBACK_PATH},
    ),
    einsum_case("einsum_2d", "ab,bc->ac", (5,), 4, bias_axes="c", activation="tanh"),
    einsum_case("einsum_sequence_gram", "abc,cd->abd", (2, 16), (2, 16), bias_axes="d"),
    einsum_case("einsum_sequence_materialized", "abc,cd->abd", (9, 3), (9, 4), bias_axes="d"),
    einsum_case("einsum_mha_query", "abc,cde->abde", (5, 6), (5, 2, 3), bias_axes="de"),
    einsum_case("einsum_mha_output", "abcd,cde->abe", (5, 2, 3), (5, 4), bias_axes="e"),
    einsum_case("einsum_left_ellipsis", "...b,bc->...c", (3, 4), 5, bias_axes="c"),
    einsum_case("einsum_right_ellipsis", "ab...,bc->ac...", (4, 3), 2),
    einsum_case("einsum_shared_kernel_axis", "abc,bcd->abd", (3, 4), (3, 2), bias_axes="bd"),
    einsum_case(
        "einsum_shared_axis_materialized", "abcd,cde->abce", (6, 2, 2), (6, 2, 3), bias_axes="e"
    ),
    einsum_case("einsum_bias_broadcast_axis", "abc,cde->abde", (5, 4), (5, 2, 3), bias_axes="be"),
    einsum_case("einsum_summed_input_axis", "abc,cd->ad", (3, 4), 2, activation="relu"),
    multi_head_self_attention,
    multi_head_cross_attention,
    shared_layers,
    frozen_kernel_and_gamma,
    transformer_block,
]


@pytest.mark.parametrize(
    "build", CASES, ids=lambda build: getattr(build, "__name__", None) or str(build)
)
def test_rule_matches_the_per_example_oracle(build: Callable[[], Case]) -> None:
    model, x, y, paths = build()
    plan = model.gradient_tracking_plan()
    checked = [tracked for tracked in plan if type(tracked.layer) in paths]
    assert checked, "the case has no layer of the classes under test"
    for tracked in checked:
        assert tracked.path == paths[type(tracked.layer)], tracked.name
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


@pytest.mark.parametrize(
    ("equation", "input_rank", "roles"),
    [
        ("abc,cde->abde", 3, ("a", "", "b", "c", "de")),
        ("abcd,cde->abe", 4, ("a", "", "b", "cd", "e")),
        ("abc,bcd->abd", 3, ("a", "b", "", "c", "d")),
        ("...b,bc->...c", 4, ("a", "", "de", "b", "c")),
        ("ab...,bc->ac...", 3, ("a", "", "d", "b", "c")),
    ],
)
def test_einsum_roles(equation: str, input_rank: int, roles: tuple[str, ...]) -> None:
    found = einsum_roles(equation, input_rank)
    assert found is not None
    assert (found.batch, found.shared, found.steps, found.contracted, found.produced) == roles


@pytest.mark.parametrize(
    ("equation", "input_rank"),
    [
        ("ab,bc->ca", 2),  # batch letter not first in the output
        ("ab,ac->cb", 2),  # batch letter in the kernel
        ("aab,bc->ac", 3),  # a diagonal
        ("...b,bc->...c", None),  # ellipsis with an unknown rank
    ],
)
def test_einsum_roles_refuses_equations_without_a_batch_letter(
    equation: str, input_rank: int | None
) -> None:
    assert einsum_roles(equation, input_rank) is None
