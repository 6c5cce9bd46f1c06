"""Modern Keras models: a tracked step trains exactly as plain Keras, or is refused.

Masks attached inside `call` (ReversibleEmbedding, keras_hub's embeddings, a user's
layer) reach the next layers on tracked steps; constants made outside the step (a
position index built in `build`) are exact in `fit`, `kgt.check` and the summary;
an operation that mixes the examples of a batch is refused before any weight
changes, by a generic guard, with the way out; every refusal names the way out
that fits, and `kgt.check` given a batch predicts each one `fit` would make.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from invariant import assert_tracked_step_equals_plain
from keras import layers, ops
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

rng = np.random.default_rng(11)
VOCABULARY, LENGTH, WIDTH = 20, 7, 8


def padded_ids(batch: int = 6) -> np.ndarray:
    """Token ids with trailing padding (0), of a different length per example."""
    ids = rng.integers(1, VOCABULARY, size=(batch, LENGTH))
    for i in range(batch):
        ids[i, 2 + i % (LENGTH - 2) :] = 0
    return ids


def compiled(model: Any, loss: Any = None) -> Any:
    model.compile(
        optimizer="adam",
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def exact_and_as_plain(model: Any, x: Any, y: Any, sample_weight: Any = None) -> None:
    """Exact against the oracle, and one tracked step equal to one plain Keras step."""
    stats = model.gradient_statistics(x, y, sample_weight)
    assert_matches_oracle(stats, oracle_statistics(model, x, y, sample_weight))
    assert_tracked_step_equals_plain(model, x, y, sample_weight)


# -- masks attached in `call` ---------------------------------------------------------


class MaskingTokens(layers.Layer):
    """A user's embedding that attaches its padding mask to its output in `call`."""

    def build(self, input_shape: Any) -> None:
        self.table = self.add_weight(shape=(VOCABULARY, WIDTH), initializer="normal")

    def call(self, ids: Any) -> Any:
        outputs = ops.take(self.table, ids, axis=0)
        outputs._keras_mask = ops.not_equal(ids, 0)
        return outputs


MASKING_EMBEDDINGS = {
    "reversible_embedding": lambda: layers.ReversibleEmbedding(VOCABULARY, WIDTH, mask_zero=True),
    "user_layer": MaskingTokens,
}


@pytest.mark.parametrize("embedding", sorted(MASKING_EMBEDDINGS))
def test_a_mask_set_in_call_reaches_masked_attention_and_pooling(embedding: str) -> None:
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = MASKING_EMBEDDINGS[embedding]()(inputs)
    hidden = layers.MultiHeadAttention(2, 4, name="attention")(hidden, hidden)
    pooled = layers.GlobalAveragePooling1D()(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(pooled)))
    exact_and_as_plain(model, padded_ids(), rng.integers(0, 3, size=6))


@pytest.mark.parametrize("embedding", sorted(MASKING_EMBEDDINGS))
def test_a_mask_set_in_call_reaches_a_masked_sequence_loss(embedding: str) -> None:
    """Keras masks the loss with the output's mask: the padded positions count for
    nothing, on tracked steps too (the per-example losses follow the reduction
    table; the one-example oracle would normalize by each example's own count)."""
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = MASKING_EMBEDDINGS[embedding]()(inputs)
    outputs = layers.Dense(4, name="tagger")(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    ids = padded_ids()
    y = rng.integers(0, 4, size=ids.shape)
    assert_tracked_step_equals_plain(model, ids, y)


@pytest.mark.parametrize("embedding", sorted(MASKING_EMBEDDINGS))
def test_a_mask_set_in_call_reaches_a_recurrent_layer(embedding: str) -> None:
    """The LSTM's rule runs its loop with the mask: padded steps carry the state on."""
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = layers.LSTM(5, name="lstm")(MASKING_EMBEDDINGS[embedding]()(inputs))
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    exact_and_as_plain(model, padded_ids(), rng.integers(0, 3, size=6))


def test_the_tracked_call_returns_the_mask_the_layer_attached() -> None:
    """Under the tap, the output of the layer carries the mask its own call attached."""
    seen = []

    class Probe(layers.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.supports_masking = True

        def call(self, x: Any, mask: Any = None) -> Any:
            seen.append(mask)
            return x

    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = Probe()(layers.ReversibleEmbedding(VOCABULARY, WIDTH, mask_zero=True)(inputs))
    model = compiled(
        kgt.GradientTrackingModel(inputs, layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden)))
    )
    seen.clear()
    model.gradient_statistics(padded_ids(), rng.integers(0, 3, size=6))
    assert seen and all(mask is not None for mask in seen)


# -- constants made outside the step --------------------------------------------------


class PatchesAndPositions(layers.Layer):
    """keras_hub ViT's pattern: a position index built once in `build` (an eager
    constant, outside any step) and a class token, before a learned position table."""

    def build(self, input_shape: Any) -> None:
        self.patches = layers.Dense(WIDTH, name="patches")
        self.patches.build(input_shape)
        self.class_token = self.add_weight(shape=(1, 1, WIDTH), initializer="normal")
        self.positions = layers.Embedding(input_shape[1] + 1, WIDTH, name="positions")
        self.positions.build((1, input_shape[1] + 1))
        self.position_ids = ops.expand_dims(ops.arange(input_shape[1] + 1), 0)

    def call(self, x: Any) -> Any:
        patches = self.patches(x)
        token = ops.broadcast_to(self.class_token, (ops.shape(x)[0], 1, WIDTH))
        return ops.concatenate([token, patches], axis=1) + self.positions(self.position_ids)


def patch_classifier() -> Any:
    inputs = keras.Input((5, 6))
    hidden = PatchesAndPositions(name="embedding")(inputs)
    hidden = layers.LayerNormalization(name="norm")(hidden)
    outputs = layers.Dense(3, name="head")(hidden[:, 0])
    return compiled(kgt.GradientTrackingModel(inputs, outputs))


def test_a_constant_built_outside_the_step_is_exact_in_fit_check_and_summary(
    tmp_path: Path,
) -> None:
    model = patch_classifier()
    x = rng.normal(size=(6, 5, 6)).astype("float32")
    y = rng.integers(0, 3, size=6)
    report = kgt.check(model, x=x, y=y)
    assert report.refusals == []
    assert "broadcast to it" in {row.name: row.note for row in report.layers}["positions"]
    assert "0 refused" in model.gradient_tracking_summary(print_fn=lambda _: None)
    exact_and_as_plain(model, x, y)


# -- the example-independence guard ---------------------------------------------------


class RecommenderNet(kgt.GradientTrackingMixin, keras.Model):
    """keras-io collaborative filtering, as written there: `ops.tensordot(u, v, 2)`
    sums over the batch too."""

    def __init__(self, num_users: int, num_movies: int, embedding_size: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs: Any) -> Any:
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
        return ops.nn.sigmoid(dot_user_movie + user_bias + movie_bias)


def ratings(count: int = 16) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([rng.integers(0, 10, count), rng.integers(0, 12, count)], axis=1)
    return x, rng.uniform(size=(count, 1)).astype("float32")


def recommender() -> Any:
    model = RecommenderNet(10, 12, 8)
    model.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(1e-3))
    return model


def test_an_op_mixing_examples_is_refused_before_any_weight_changes(tmp_path: Path) -> None:
    model = recommender()
    x, y = ratings()
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError, match="mixes the examples of a batch") as refused:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    assert "ops.tensordot(u, v, 2)" in str(refused.value)
    assert "check_example_independence = False" in str(refused.value)
    assert int(model.optimizer.iterations.numpy()) == 0
    # `kgt.check` given a batch predicts it; so does `gradient_statistics`.
    assert any("mixes the examples" in r for r in kgt.check(model, x=x[:8], y=y[:8]).refusals)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        model.gradient_statistics(x[:8], y[:8])


def test_the_guard_passes_a_fixed_model_and_can_be_switched_off(tmp_path: Path) -> None:
    x, y = ratings()

    class Fixed(RecommenderNet):
        def call(self, inputs: Any) -> Any:
            user_vector = self.user_embedding(inputs[:, 0])
            movie_vector = self.movie_embedding(inputs[:, 1])
            dot = ops.sum(user_vector * movie_vector, axis=-1, keepdims=True)
            biases = self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1])
            return ops.nn.sigmoid(dot + biases)

    fixed = Fixed(10, 12, 8)
    fixed.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(1e-3))
    fixed.fit(x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "a.h5")])
    assert_matches_oracle(
        fixed.gradient_statistics(x[:8], y[:8]), oracle_statistics(fixed, x[:8], y[:8])
    )

    unchecked = recommender()
    unchecked.check_example_independence = False
    unchecked.fit(
        x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "b.h5")]
    )
    assert int(unchecked.optimizer.iterations.numpy()) == 2
    with pytest.raises(TypeError, match="check_example_independence to be a bool"):
        unchecked.check_example_independence = "no"  # type: ignore[assignment]


def test_the_guard_leaves_states_and_metrics_as_they_were(tmp_path: Path) -> None:
    """A stateful recurrent layer and the metrics see the guard's forward passes
    undone: the tracked fit equals plain Keras (the invariant compares states)."""
    inputs = keras.Input((4, 3), batch_size=4)
    hidden = layers.SimpleRNN(5, stateful=True, name="rnn")(inputs)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    x = rng.normal(size=(4, 4, 3)).astype("float32")
    y = rng.integers(0, 3, size=4)
    model(x)
    assert_tracked_step_equals_plain(model, x, y)


# -- refusals: the right way out, and `kgt.check` predicts each ------------------------


class CTCLayer(layers.Layer):
    """The keras-io OCR example's loss layer (a stand-in loss of the same shape)."""

    def call(self, y_true: Any, y_pred: Any) -> Any:
        self.add_loss(ops.mean(ops.square(y_pred - y_true)))  # keras-io: ctc_batch_cost
        return y_pred


class Sampling(layers.Layer):
    """A VAE encoder's sampling layer that adds the KL term with `add_loss`."""

    def call(self, inputs: Any) -> Any:
        mean, log_var = inputs
        kl = -0.5 * ops.mean(ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1))
        self.add_loss(kl)
        return mean


class OrthogonalRegularizer(keras.regularizers.Regularizer):
    """keras-io PointNet's regularizer of the feature transform (an activity regularizer)."""

    def __init__(self, num_features: int) -> None:
        self.num_features = num_features
        self.eye = ops.eye(num_features)

    def __call__(self, x: Any) -> Any:
        x = ops.reshape(x, (-1, self.num_features, self.num_features))
        xxt = ops.tensordot(x, x, axes=(2, 2))
        xxt = ops.reshape(xxt, (-1, self.num_features, self.num_features))
        return ops.sum(0.001 * ops.square(xxt - self.eye))


def contrastive(y_true: Any, y_pred: Any) -> Any:
    """A contrastive loss that reduces over the batch itself."""
    similarity = ops.matmul(y_pred, ops.transpose(y_pred))
    return ops.mean(ops.logsumexp(similarity, axis=1) - ops.diagonal(similarity))


class OwnStep(kgt.GradientTrackingModel):
    """A train_step of its own with a contrastive loss computed by hand, its gradient
    taken by `tracked_gradient` (or, with `tracked=False`, by `tape.gradient`)."""

    def __init__(self, tracked: bool = True) -> None:
        super().__init__()
        self.tower = layers.Dense(3)
        self.tracked = tracked

    def call(self, x: Any) -> Any:
        return self.tower(x)

    def train_step(self, data: Any) -> Any:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = contrastive(None, self(x))
        variables = self.trainable_variables
        if self.tracked:
            gradients = self.tracked_gradient(tape, loss, variables)
        else:
            gradients = tape.gradient(loss, variables)
        self.optimizer.apply(gradients, variables)
        return {"loss": loss}


def dense_model(hidden: Any = None, **dense: Any) -> Any:
    inputs = keras.Input((4,))
    outputs = layers.Dense(3, name="out", **dense)(inputs if hidden is None else hidden(inputs))
    return kgt.GradientTrackingModel(inputs, outputs)


def refusal_cases() -> dict[str, tuple[Any, Any, Any, str]]:
    """Each refusal kind: `(model, x, y, what the error says)`."""
    x = rng.normal(size=(6, 4)).astype("float32")
    y = rng.integers(0, 3, size=6)
    cases: dict[str, tuple[Any, Any, Any, str]] = {}

    inputs, labels = keras.Input((4,)), keras.Input((3,))
    model = kgt.GradientTrackingModel(
        [inputs, labels], CTCLayer(name="ctc_loss")(labels, layers.Dense(3)(inputs))
    )
    model.compile(optimizer="adam")
    cases["ctc_layer"] = (model, [x, rng.normal(size=(6, 3)).astype("float32")], None, "CTC()")

    inputs = keras.Input((4,))
    mean, log_var = layers.Dense(2, name="mean")(inputs), layers.Dense(2, name="log_var")(inputs)
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3)(Sampling()([mean, log_var])))
    cases["vae_kl"] = (compiled(model), x, y, "per_example_loss=reconstruction + kl")

    model = dense_model(lambda h: layers.Dense(4, activity_regularizer=OrthogonalRegularizer(2))(h))
    cases["activity_regularizer"] = (compiled(model), x, y, "PointNet's orthogonality term")

    model = dense_model()
    model.compile(optimizer="adam", loss=contrastive)
    cases["reduced_loss"] = (model, x, y, "returned one value for the whole batch")

    model = OwnStep()
    model.compile(optimizer="adam")
    cases["contrastive_train_step"] = (model, x, None, "contrastive loss such as InfoNCE")

    model = recommender()
    xr, yr = ratings(6)
    cases["examples_mixed"] = (model, xr, yr, "mixes the examples of a batch")

    model = dense_model(lambda h: layers.BatchNormalization(name="bn")(layers.Dense(4)(h)))
    cases["batch_normalization"] = (compiled(model), x, y, "convert_to_group_normalization")

    inputs = keras.Input((4,))
    model = kgt.GradientTrackingModel(inputs, layers.Dense(3)(inputs))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
    )
    cases["unreduced_loss"] = (model, x, y, "reduction without a per-example factor")

    inputs = keras.Input((5,), dtype="int32")
    embedding = layers.Embedding(10, 4, name="tokens")
    hidden = layers.Dense(4, name="hidden")(embedding(inputs))
    outputs = layers.GlobalAveragePooling1D()(TiedOutput(embedding)(hidden))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    cases["tied_weights"] = (model, rng.integers(0, 10, (6, 5)), rng.integers(0, 10, 6), "tied")

    model = compiled(dense_model(lambda h: Looped()(h)))
    cases["call_in_a_loop"] = (model, x, y, "inside a loop")

    inputs = keras.Input((5, 4))
    token = TiledToken(name="cls")
    hidden = layers.GlobalAveragePooling1D()(token(inputs))
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3)(hidden)))
    cases["batchless_tiled"] = (model, rng.normal(size=(6, 5, 4)).astype("float32"), y, "Tile")

    inputs = keras.Input((4,))
    model = kgt.GradientTrackingModel(
        inputs,
        {
            "value": layers.Dense(2, name="value")(inputs),
            "label": layers.Dense(3, name="label")(inputs),
        },
    )
    model.compile(
        optimizer="adam",
        loss={
            "value": keras.losses.MeanSquaredError(reduction="sum"),
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
    )
    two = {"value": rng.normal(size=(6, 2)).astype("float32"), "label": y}
    cases["loss_factors_differ"] = (model, x, two, "reduce with different factors")

    model = OwnStep(tracked=False)
    model.compile(optimizer="adam")
    cases["train_step_without_tracked_gradient"] = (model, x, None, "did not call")
    return cases


class TiedOutput(layers.Layer):
    """Projects onto the vocabulary with an Embedding's table (weight tying)."""

    def __init__(self, embedding: layers.Embedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h: Any) -> Any:
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


class Looped(layers.Layer):
    """Calls its Dense twice inside a tf.while_loop."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, activation="tanh")

    def call(self, x: Any) -> Any:
        return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, self.dense(h)), (0, x))[1]


class TiledToken(layers.Layer):
    """A [CLS] token looked up by a constant id, then tiled by the batch size."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token = layers.Embedding(1, 4)

    def call(self, x: Any) -> Any:
        token = self.token(ops.zeros((1, 1), "int32"))
        return ops.concatenate([ops.tile(token, (ops.shape(x)[0], 1, 1)), x], axis=1)


def without_numbers(text: str) -> str:
    return re.sub(r"[-+]?\d[\d.e+-]*", "#", text.strip())


CASES = sorted(refusal_cases())


@pytest.mark.parametrize("case", CASES)
def test_check_predicts_each_refusal_fit_makes_and_names_the_way_out(
    tmp_path: Path, case: str
) -> None:
    model, x, y, says = refusal_cases()[case]
    predicted = kgt.check(model, x=x, y=y).refusals
    assert any(says in refusal for refusal in predicted), predicted
    weights = [v.numpy() for v in model.trainable_variables]
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    with pytest.raises(ValueError) as refused:
        model.fit(x, y, batch_size=6, epochs=1, verbose=0, callbacks=[logger])
    assert says in str(refused.value)
    # The same refusal (its measured numbers aside: a check's batch may differ).
    assert without_numbers(str(refused.value)) in [without_numbers(r) for r in predicted]
    for variable, before in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(variable.numpy(), before)
