"""Layers called on values that do not depend on the batch: a learned position table
(`pos_emb(ops.arange(maxlen))`), a Dense applied to a constant, a token looked up by a
constant id. Each is exact against the oracle (the per-example gradient flows through
the broadcast where the output meets the batch), or refused with an error that names
the layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops
from keras_io_layers import PatchEncoder, TokenAndPositionEmbedding
from oracle import assert_matches_oracle, oracle_statistics
from zoo_models import TransformerBlock

import keras_gradtrack as kgt

BATCH = 6
rng = np.random.default_rng(3)


def classifier(body: Any, input_shape: tuple[Any, ...], dtype: str = "float32") -> Any:
    inputs = keras.Input(input_shape, dtype=dtype)
    hidden = layers.Flatten()(body(inputs))
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def assert_exact(model: Any, x: Any) -> None:
    y = rng.integers(0, 3, len(x))
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))


def notes(model: Any) -> dict[str, str]:
    return {row.name: row.note for row in kgt.check(model).layers}


class LearnedBias(layers.Layer):
    """A bias produced by a small network from a constant, added to every example."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.generator = layers.Dense(units, activation="tanh")

    def call(self, x: Any) -> Any:
        return x + self.generator(ops.ones((1, 3)))


class EmbeddedClassToken(layers.Layer):
    """A [CLS] token looked up by a constant id, broadcast to the batch and prepended."""

    def __init__(self, dim: int, tile: bool = False) -> None:
        super().__init__()
        self.token = layers.Embedding(1, dim)
        self.dim = dim
        self.tile = tile

    def call(self, x: Any) -> Any:
        token = self.token(ops.zeros((1, 1), "int32"))  # (1, 1, dim)
        batch = ops.shape(x)[0]
        if self.tile:
            token = ops.tile(token, (batch, 1, 1))
        else:
            token = ops.broadcast_to(token, (batch, 1, self.dim))
        return ops.concatenate([token, x], axis=1)


class ClassToken(layers.Layer):
    """A [CLS] token of the layer's own, broadcast to the batch inside its call."""

    def build(self, input_shape: Any) -> None:
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), initializer="random_normal")

    def call(self, x: Any) -> Any:
        token = ops.broadcast_to(self.token, (ops.shape(x)[0], 1, ops.shape(x)[-1]))
        return ops.concatenate([token, x], axis=1)


@pytest.mark.parametrize("maxlen", [BATCH, None], ids=["maxlen_equals_batch", "any_length"])
def test_token_and_position_embedding_with_a_transformer_block_is_exact(maxlen: Any) -> None:
    """keras-io text_classification_with_transformer, where the position table's call
    on `ops.arange(maxlen)` crashed; with the sequence length equal to the batch size
    static shapes cannot tell the table's rows from examples."""

    embedding = TokenAndPositionEmbedding(BATCH, 20, 8)

    def body(inputs: Any) -> Any:
        return layers.GlobalAveragePooling1D()(
            TransformerBlock(8, 2, 8, rate=0.0)(embedding(inputs))
        )

    model = classifier(body, (maxlen,), "int32")
    assert "broadcast" in notes(model)[embedding.pos_emb.name]
    assert notes(model)[embedding.token_emb.name] == ""
    assert_exact(model, rng.integers(0, 20, (BATCH, BATCH)))


def test_a_position_index_with_a_leading_axis_of_one_is_exact() -> None:
    model = classifier(PatchEncoder(5, 4), (5, 3))
    assert_exact(model, rng.normal(size=(BATCH, 5, 3)).astype("float32"))


def test_a_dense_applied_to_a_constant_is_exact() -> None:
    model = classifier(LearnedBias(4), (4,))
    assert_exact(model, rng.normal(size=(BATCH, 4)).astype("float32"))


def test_a_dense_on_values_of_the_batch_size_only_keeps_its_rows() -> None:
    """`ops.ones((batch, 3))` depends on the batch's size, not its values: it already
    has a row per example, and is not broadcast again."""

    class OnesDense(layers.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.dense = layers.Dense(4)

        def call(self, x: Any) -> Any:
            return x * self.dense(ops.ones((ops.shape(x)[0], 3)))

    layer = OnesDense()
    model = classifier(layer, (4,))
    assert notes(model)[layer.dense.name] == ""
    assert_exact(model, rng.normal(size=(BATCH, 4)).astype("float32"))


@pytest.mark.parametrize("layer", [EmbeddedClassToken, ClassToken])
def test_class_token_layers_are_exact(layer: type) -> None:
    model = classifier(layer(4) if layer is EmbeddedClassToken else layer(), (5, 4))
    assert_exact(model, rng.normal(size=(BATCH, 5, 4)).astype("float32"))


def test_a_batchless_output_tiled_over_the_batch_is_refused_naming_the_layer(
    tmp_path: Path,
) -> None:
    """Tiling the broadcast token by the batch size would give B * B rows."""
    layer = EmbeddedClassToken(4, tile=True)
    model = classifier(layer, (5, 4))
    row = next(row for row in kgt.check(model).layers if row.name == layer.token.name)
    assert row.path == "refused" and "(type Tile)" in row.refusal
    x = rng.normal(size=(BATCH, 5, 4)).astype("float32")
    message = f"Layer '{layer.token.name}' \\(Embedding\\) is called on values"
    with pytest.raises(ValueError, match=message):
        model.fit(
            x,
            rng.integers(0, 3, BATCH),
            verbose=0,
            callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
        )


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
def test_a_bias_broadcast_against_sequences_is_refused_naming_the_layer(
    tmp_path: Path, run_eagerly: bool
) -> None:
    """A `(1, units)` bias added to `(B, T, units)` aligns its leading axis with T:
    broadcast to `(B, units)` it would align the batch with T. Traced, the step
    refuses it before any weight changes; eager, the shape error that follows gets
    a note naming the broadcast layer."""
    layer = LearnedBias(4)
    model = classifier(layer, (5, 4))
    model.compile(optimizer="sgd", loss=model.loss, run_eagerly=run_eagerly)
    x = rng.normal(size=(BATCH, 5, 4)).astype("float32")
    # Eager, TensorFlow's own shape error is an InvalidArgumentError.
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as raised:
        model.fit(
            x,
            rng.integers(0, 3, BATCH),
            verbose=0,
            callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
        )
    if run_eagerly:
        expected = f"broadcast the calls of layers [{layer.generator.name!r}]"
        assert expected in "".join(raised.value.__notes__)
    else:
        assert f"Layer {layer.generator.name!r} (Dense) is called on values" in str(raised.value)
        assert "(type AddV2)" in str(raised.value)


def test_an_eager_step_broadcasts_a_position_table(tmp_path: Path) -> None:
    """`run_eagerly=True`: without a graph, a call is batchless when no argument has
    the batch's leading size (here 5 examples, 6 positions)."""

    def body(inputs: Any) -> Any:
        return TokenAndPositionEmbedding(6, 20, 8)(inputs)

    model = classifier(body, (6,), "int32")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=model.loss, run_eagerly=True)
    x, y = rng.integers(0, 20, (5, 6)), rng.integers(0, 3, 5)
    model.fit(
        x,
        y,
        batch_size=5,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = {name: log.per_example(name) for name in ("loss", "grad_norm", "cosine")}
        logged["layer_grad_norm"] = log.per_example("layer_grad_norm")
    assert_matches_oracle(logged, oracle_statistics(model, x, y))


def test_a_dense_after_a_size_losing_layer_works_with_the_batch_size_unknown(
    tmp_path: Path,
) -> None:
    """Tracked steps trace with the batch size unknown (so that sizes read from the batch
    stay tied to it). A dilated convolution then loses its static length, and the
    Flatten after it its static size: the Dense rule takes its sizes from its kernel."""
    inputs = keras.Input((11, 3))
    convolved = layers.DepthwiseConv1D(3, strides=2, dilation_rate=2, padding="same")(inputs)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(2)(layers.Flatten()(convolved)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = rng.normal(size=(7, 11, 3)).astype("float32"), rng.normal(size=(7, 2))
    model.fit(
        x,
        y,
        batch_size=7,
        verbose=0,
        shuffle=False,
        callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")],
    )
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        logged = {name: log.per_example(name) for name in ("grad_norm", "layer_grad_norm")}
    assert_matches_oracle(logged, oracle_statistics(model, x, y))
