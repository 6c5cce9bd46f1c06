"""Materialized layers on batches larger than a chunk (`engine.chunked`): per-example
gradients one chunk of examples at a time, kept as squared norms and the batch
gradient, `<g_i, R>` by the rule's `dot` (the layer's linear map applied to R).

Chunks of 3 examples here (`EXAMPLES_PER_CHUNK` and `LARGE_BATCH_CHUNK` patched): a batch of 8 takes
three chunks, the last one short; a batch of 3 runs the loops once. Each case checks the logged statistics of one `fit` step
against the one-tape-per-example oracle and the update against plain Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.engine import backward, chunked
from keras_gradtrack.rules import LayerCall, Reference, chunks, lookup
from keras_gradtrack.statistics import DEFAULT_STATISTICS

L = keras.layers
rng = np.random.default_rng(11)
CHUNK = 3

CASES = {
    "conv1d_causal_dilated": (
        lambda: L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu"),
        (11, 5),
    ),
    "conv2d_strided": (lambda: L.Conv2D(5, 3, strides=2, padding="same"), (9, 8, 6)),
    "conv2d_groups": (lambda: L.Conv2D(8, 3, groups=2, activation="tanh"), (5, 5, 8)),
    "conv2d_one_channel": (lambda: L.Conv2D(32, 3), (5, 5, 1)),
    "conv3d": (lambda: L.Conv3D(6, 2), (3, 3, 3, 4)),
    "depthwise2d": (lambda: L.DepthwiseConv2D(3, depth_multiplier=2, strides=2), (7, 6, 5)),
    "depthwise1d": (lambda: L.DepthwiseConv1D(5), (6, 4)),
    "conv2d_transpose": (
        lambda: L.Conv2DTranspose(8, 3, strides=2, padding="same", activation="relu"),
        (3, 3, 12),
    ),
    "conv1d_transpose": (lambda: L.Conv1DTranspose(8, 3, strides=2), (10, 24)),
    "separable2d": (
        lambda: L.SeparableConv2D(6, 3, depth_multiplier=2, padding="same", activation="relu"),
        (3, 3, 5),
    ),
    "separable1d": (lambda: L.SeparableConv1D(24, 5, padding="same"), (10, 16)),
    "regularized_without_bias": (
        lambda: L.Conv2D(4, 3, use_bias=False, kernel_regularizer=keras.regularizers.L2(0.05)),
        (7, 7, 6),
    ),
}


def model_of(make: Callable[[], Any], input_shape: Any) -> keras.Model:
    inputs = keras.Input(input_shape)
    hidden = L.Flatten()(make()(inputs))
    model = kgt.GradientTrackingModel(inputs, L.Dense(3)(hidden))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


@pytest.fixture
def chunks_of_three(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Chunks of 3 examples for every layer whose rule has `dot` (also those whose
    gradient is smaller than their activations); records which layers
    `chunked_gradients` took."""
    monkeypatch.setattr(chunks, "EXAMPLES_PER_CHUNK", CHUNK)
    monkeypatch.setattr(chunks, "LARGE_BATCH_CHUNK", CHUNK)
    monkeypatch.setattr(chunked, "outweighs_its_activations", lambda tracked, calls: True)
    taken: list[tuple[str, Any]] = []
    original = chunked.chunked_gradients

    def recording(tracked: Any, calls: Any, per_example: Any) -> chunked.Chunked:
        taken.append((tracked.name, calls[0].tapped[0].shape[0]))
        return original(tracked, calls, per_example)

    monkeypatch.setattr(backward, "chunked_gradients", recording)
    return taken


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("batch", [8, 3])
def test_chunks_match_the_oracle_and_plain_keras(
    case: str, batch: int, chunks_of_three: list[tuple[str, Any]], tmp_path: Path
) -> None:
    make, input_shape = CASES[case]
    model = model_of(make, input_shape)
    (row, *_) = kgt.check(model).layers
    assert row.form == "materialized", row
    x, y = rng.normal(size=(batch, *input_shape)), rng.integers(0, 3, batch)
    expected = oracle_statistics(model, x, y)
    plain = keras.Model.from_config(model.get_config())
    plain.compile(optimizer="sgd", loss=model.loss)
    plain.set_weights(model.get_weights())
    plain.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path)
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[logger])

    # fit's batch size is only known at run time: the step takes the chunks (three
    # for 8 examples, one for 3).
    assert (row.name, None) in chunks_of_three
    with kgt.GradientLog(path) as log:
        logged = {name: log.per_example(name) for name in log.per_example_names}
        logged.update({name: log.per_step(name)[0] for name in log.per_step_names})
    assert_matches_oracle(logged, expected)
    for actual, wanted in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-6)


def test_a_shared_layer_and_sample_weights_in_chunks(
    chunks_of_three: list[tuple[str, Any]],
) -> None:
    """A convolution called twice (its calls' per-example gradients add up chunk by
    chunk), with sample weights, through `gradient_statistics`."""
    inputs = keras.Input((3, 3, 6))
    shared = L.Conv2D(6, 3, padding="same", activation="relu", name="shared")
    hidden = L.Conv2D(3, 1)(shared(shared(inputs)))
    model = kgt.GradientTrackingModel(inputs, L.Dense(2)(L.Flatten()(hidden)))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = rng.normal(size=(7, 3, 3, 6)), rng.integers(0, 2, 7)
    weights = rng.uniform(0.2, 2.0, 7)
    stats = model.gradient_statistics(x, y, sample_weight=weights, statistics=DEFAULT_STATISTICS)
    assert ("shared", None) in chunks_of_three
    assert_matches_oracle(stats, oracle_statistics(model, x, y, sample_weight=weights))


def test_statistics_that_read_per_example_gradients_keep_them_whole(
    chunks_of_three: list[tuple[str, Any]],
) -> None:
    """`pairwise_cosine` reads the per-example gradients themselves: no chunks."""
    make, input_shape = CASES["conv2d_strided"]
    model = model_of(make, input_shape)
    x, y = rng.normal(size=(8, *input_shape)), rng.integers(0, 3, 8)
    stats = model.gradient_statistics(x, y, statistics=[*DEFAULT_STATISTICS, "pairwise_cosine"])
    assert chunks_of_three == []
    assert_matches_oracle(stats, oracle_statistics(model, x, y))


@pytest.mark.parametrize(
    ("make", "input_shape", "takes_chunks"),
    [
        # ResNet-8's last convolutions: 36 928 parameters against 4 096 inputs and
        # 4 096 outputs per example.
        (lambda: L.Conv2D(64, 3, padding="same"), (8, 8, 64), True),
        # 220 parameters against 600 inputs and 256 outputs.
        (lambda: L.Conv2D(4, 3), (10, 10, 6), False),
    ],
    ids=["kernel_outweighs", "activations_outweigh"],
)
def test_chunks_are_taken_where_a_gradient_outweighs_its_activations(
    make: Callable[[], Any], input_shape: Any, takes_chunks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks' second pass holds the layer's input and output gradient until the
    batch gradient exists: taken only where that is less than the per-example
    gradients it saves."""
    monkeypatch.setattr(chunks, "EXAMPLES_PER_CHUNK", CHUNK)
    monkeypatch.setattr(chunks, "LARGE_BATCH_CHUNK", CHUNK)
    taken: list[str] = []
    original = chunked.chunked_gradients
    monkeypatch.setattr(
        backward,
        "chunked_gradients",
        lambda tracked, *args: taken.append(tracked.name) or original(tracked, *args),
    )
    model = model_of(make, input_shape)
    (row, *_) = kgt.check(model).layers
    assert row.form == "materialized"
    x, y = rng.normal(size=(7, *input_shape)), rng.integers(0, 3, 7)
    assert_matches_oracle(model.gradient_statistics(x, y), oracle_statistics(model, x, y))
    assert taken == ([row.name] if takes_chunks else [])


@pytest.mark.parametrize("case", sorted(CASES))
def test_dot_equals_the_rules_per_example_gradients_against_any_reference(case: str) -> None:
    """`Rule.dot` equals `<g_i, R>` from the rule's own per-example gradients for a
    random R and random output gradients, so a dot that agrees only at R = G, or
    only for the gradients a loss produces, fails."""
    make, input_shape = CASES[case]
    layer = make()
    x = tf.constant(rng.normal(size=(5, *input_shape)), tf.float32)
    layer(x)  # builds it
    rule = lookup(layer).rule
    assert rule is not None and rule.dot is not None and rule.per_example is not None
    tapped = rule.tap(layer, layer.call, (x,), {}).tapped if rule.tap else (layer(x),)
    grads = tuple(tf.constant(rng.normal(size=t.shape), tf.float32) for t in tapped)
    calls = [LayerCall((x,), {}, tapped, output_grads=grads)]
    reference = Reference(
        {
            id(v): tf.constant(rng.normal(size=v.shape), tf.float32)
            for v in layer.trainable_variables
        }
    )
    expected = sum(
        np.reshape(g, (5, -1)) @ np.reshape(reference(v), -1)
        for v, g in rule.per_example(layer, calls)
    )
    np.testing.assert_allclose(rule.dot(layer, calls, reference), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("batch", "size", "count"), [(1, 128, 1), (128, 128, 1), (129, 64, 3), (512, 64, 8)]
)
def test_a_batch_up_to_a_chunk_is_one_chunk_and_larger_ones_go_64_at_a_time(
    batch: int, size: int, count: int
) -> None:
    assert [int(t) for t in chunks.chunking(tf.constant(batch))] == [size, count]
