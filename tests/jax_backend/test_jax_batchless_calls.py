"""Layers called on values that do not depend on the batch, on JAX: a learned position
table (keras-io's `TokenAndPositionEmbedding`, `pos_emb(ops.arange(maxlen))`) and a
`(1, num_patches)` position index. Each is exact against the per-example oracle
(example i's gradient is its output gradient at the positions, summed by the ids),
whether or not the sequence length equals the batch size; one whose outputs reach the
batch other than row by row is refused, naming the layer."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from backend_oracle import tracked_statistics
from jax_oracle import assert_matches_oracle, oracle_statistics
from keras import layers, ops
from keras_io_layers import PatchEncoder, TokenAndPositionEmbedding
from test_jax_own_train_step import keras_step_class

import keras_gradtrack as kgt

BATCH = 6
rng = np.random.default_rng(3)


class SummedPositions(layers.Layer):
    """Adds the sum of the position table's rows: the broadcast axis is reduced."""

    def __init__(self, maxlen: int, dim: int) -> None:
        super().__init__()
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=dim)

    def call(self, x: Any) -> Any:
        positions = self.pos_emb(ops.arange(ops.shape(x)[1]))
        return x + ops.sum(positions, axis=0)


def classifier(
    body: Any,
    input_shape: tuple[int, ...],
    dtype: str = "float32",
    model_class: type = kgt.GradientTrackingModel,
) -> Any:
    inputs = keras.Input(input_shape, dtype=dtype)
    hidden = layers.Flatten()(body(inputs))
    model = model_class(inputs, layers.Dense(3)(hidden))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


@pytest.mark.parametrize("maxlen", [BATCH, 5], ids=["length_equals_batch", "length_5"])
def test_a_learned_position_table_is_exact(maxlen: int) -> None:
    model = classifier(TokenAndPositionEmbedding(maxlen, 7, 4), (maxlen,), dtype="int32")
    x = rng.integers(0, 7, (BATCH, maxlen)).astype("int32")
    y = rng.integers(0, 3, BATCH)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(model.gradient_statistics(x, y), expected)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_a_position_index_with_a_leading_axis_of_one_is_exact() -> None:
    model = classifier(PatchEncoder(4, 5), (4, 3))
    x = rng.normal(size=(BATCH, 4, 3)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_outputs_reduced_over_the_broadcast_axis_are_refused() -> None:
    model = classifier(SummedPositions(4, 3), (4, 3))
    x = rng.normal(size=(BATCH, 4, 3)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    before = model.get_weights()
    with pytest.raises(ValueError, match="do not depend on the batch"):
        tracked_statistics(model, x, y)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


class OwnLoss(kgt.GradientTrackingModel):
    """Its own `compute_loss` (Keras' documented signature before `training`): the
    tracked step records the Keras losses it reduces."""

    def compute_loss(self, x, y, y_pred, sample_weight):
        return super().compute_loss(x, y, y_pred, sample_weight)


def test_a_position_table_is_exact_under_a_compute_loss_of_ones_own() -> None:
    maxlen = BATCH
    inputs = keras.Input((maxlen,), dtype="int32")
    hidden = layers.Flatten()(TokenAndPositionEmbedding(maxlen, 7, 4)(inputs))
    model = OwnLoss(inputs, layers.Dense(3)(hidden))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = rng.integers(0, 7, (BATCH, maxlen)).astype("int32")
    y = rng.integers(0, 3, BATCH)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


@pytest.mark.parametrize("maxlen", [BATCH, 5], ids=["length_equals_batch", "length_5"])
def test_a_position_table_is_exact_inside_a_train_step_of_ones_own(maxlen: int) -> None:
    # The step's data is known to the step only: its batchless calls are found by two
    # abstract traces of the whole train_step, at the batch and at one example more.
    own_step = keras_step_class(kgt.GradientTrackingModel, tracked=True)
    body = TokenAndPositionEmbedding(maxlen, 7, 4)
    model = classifier(body, (maxlen,), dtype="int32", model_class=own_step)
    x = rng.integers(0, 7, (BATCH, maxlen)).astype("int32")
    y = rng.integers(0, 3, BATCH)
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
