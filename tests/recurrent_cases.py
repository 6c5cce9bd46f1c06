"""Recurrent layers on a probed engine (JAX, PyTorch): LSTM, GRU and SimpleRNN on their
rule, inside Keras' own loop; other recurrent layers (cells of one's own, stacked
cells, ConvLSTM, partly frozen cells) on the per-layer fallback.

Against the backend's own oracle (`jax.grad`, `torch.autograd.grad`, one example at a
time; rtol 1e-4, float32), tracked equals plain, the path column, and the refusals of
what the fallback cannot track. Each backend's test module imports these cases.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from backend_models import compiled
from backend_oracle import assert_trains_as_plain, tracked_statistics
from extended import with_extended
from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell
from tolerance import assert_matches_oracle

import keras_gradtrack as kgt
from keras_gradtrack import statistics

BACKEND = keras.backend.backend()
oracle_statistics = importlib.import_module(f"{BACKEND}_oracle").oracle_statistics
FALLBACK_PATH = importlib.import_module(f"keras_gradtrack.backends.{BACKEND}.plan").FALLBACK_PATH

L = keras.layers
BATCH, LENGTH, VOCAB = 6, 7, 20
rng = np.random.default_rng(0)


def token_ids(batch: int = BATCH, padded: bool = False) -> np.ndarray:
    ids = rng.integers(1, VOCAB, (batch, LENGTH)).astype("int32")
    if padded:  # trailing padding of different lengths, one example unpadded
        for i in range(batch):
            ids[i, LENGTH - i % 4 :] = 0
    return ids


def text_classifier(model_class: type, recurrent: Any, mask_zero: bool = False) -> Any:
    """keras-io's text classification: Embedding -> recurrent -> Dense."""
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = L.Embedding(VOCAB, 5, mask_zero=mask_zero)(inputs)
    return model_class(inputs, L.Dense(3)(recurrent(hidden)))


def bidirectional_stack(model_class: type, mask_zero: bool = False) -> Any:
    """keras-io `bidirectional_lstm_imdb`: two stacked Bidirectional(LSTM)."""
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = L.Embedding(VOCAB, 5, mask_zero=mask_zero)(inputs)
    hidden = L.Bidirectional(L.LSTM(4, return_sequences=True))(hidden)
    hidden = L.Bidirectional(L.LSTM(3))(hidden)
    return model_class(inputs, L.Dense(3)(hidden))


def gru_model(model_class: type, reset_after: bool = True) -> Any:
    inputs = keras.Input((LENGTH, 4))
    hidden = L.GRU(5, return_sequences=True, reset_after=reset_after)(inputs)
    hidden = L.GRU(3, go_backwards=True, reset_after=reset_after)(hidden)
    return model_class(inputs, L.Dense(3)(hidden))


# name -> (model builder, inputs)
CASES: dict[str, tuple[Callable[[type], Any], Callable[[], np.ndarray]]] = {
    "lstm": (lambda c: text_classifier(c, L.LSTM(6)), token_ids),
    "lstm_sequences_masked": (
        lambda c: text_classifier(
            c, lambda h: L.GlobalAveragePooling1D()(L.LSTM(4, return_sequences=True)(h)), True
        ),
        lambda: token_ids(padded=True),
    ),
    "bidirectional_lstm": (bidirectional_stack, token_ids),
    "bidirectional_lstm_masked": (
        lambda c: bidirectional_stack(c, mask_zero=True),
        lambda: token_ids(padded=True),
    ),
    "gru": (gru_model, lambda: rng.normal(size=(BATCH, LENGTH, 4)).astype("float32")),
    "gru_reset_before": (
        lambda c: gru_model(c, reset_after=False),
        lambda: rng.normal(size=(BATCH, LENGTH, 4)).astype("float32"),
    ),
    "simple_rnn": (
        lambda c: text_classifier(
            c, lambda h: L.SimpleRNN(4, go_backwards=True)(L.SimpleRNN(5, return_sequences=True)(h))
        ),
        token_ids,
    ),
    "simple_rnn_masked_unrolled": (
        lambda c: text_classifier(c, L.SimpleRNN(4, unroll=True, use_bias=False), True),
        lambda: token_ids(padded=True),
    ),
}


# The unmasked stack of Bidirectional LSTMs repeats its masked twin; GRU's
# `reset_after=False` its default's path: `make test-all`.
EXTENDED = {"bidirectional_lstm", "gru_reset_before"}


@pytest.mark.parametrize(
    "name",
    with_extended(sorted(CASES), EXTENDED),
)
def test_recurrent_models_match_the_oracle(name: str) -> None:
    build, data = CASES[name]
    model = compiled(build(kgt.GradientTrackingModel))
    x, y = data(), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
    summary = model.gradient_tracking_summary()
    assert "rule:recurrent" in summary and "fallback" not in summary, summary


@pytest.mark.parametrize("name", ["lstm", "bidirectional_lstm_masked", "gru", "gru_reset_before"])
def test_a_tracked_recurrent_step_trains_as_keras_does(name: str) -> None:
    build, data = CASES[name]
    x, y = np.concatenate([data(), data()]), rng.integers(0, 3, 2 * BATCH)
    tracked, plain = compiled(build(kgt.GradientTrackingModel)), compiled(build(keras.Model))
    assert_trains_as_plain(tracked, plain, x, y, BATCH)


def test_returned_states_initial_states_and_a_shared_layer() -> None:
    """An encoder's states start a decoder; one SimpleRNN reads two inputs (its calls
    add up), one of them masked."""
    source, target = keras.Input((6, 2)), keras.Input((4, 2))
    _, state_h, state_c = L.LSTM(3, return_state=True)(source)
    decoded = L.LSTM(3, return_sequences=True)(target, initial_state=[state_h, state_c])
    shared = L.SimpleRNN(2)
    pair = L.Concatenate()([shared(source), shared(L.Masking()(target))])
    outputs = L.Dense(3)(L.Concatenate()([L.Flatten()(decoded), pair, state_c]))
    model = compiled(kgt.GradientTrackingModel([source, target], outputs))
    target_values = rng.normal(size=(BATCH, 4, 2)).astype("float32")
    target_values[::2, 2:] = 0.0  # masked steps at the end of every other example
    x = [rng.normal(size=(BATCH, 6, 2)).astype("float32"), target_values]
    y = rng.integers(0, 3, BATCH)
    model([v[:1] for v in x])
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def fixed_dropout_mask(self: Any, step_input: Any, dropout_rate: float) -> Any:
    """A dropout mask that is the same for every example and differs per gate, so the
    oracle's one-example batches see the batch's masks."""
    width = step_input.shape[-1]

    def mask(gate: int) -> Any:
        keep = (np.arange(width) + gate) % 3 != 0
        scale = keras.ops.convert_to_tensor((keep / (1.0 - dropout_rate)).astype("float32"))
        return keras.ops.ones_like(step_input) * scale

    count = getattr(self, "dropout_mask_count", None)
    return mask(0) if count is None else [mask(gate) for gate in range(count)]


def test_dropout_and_recurrent_dropout_use_the_cells_masks(monkeypatch: Any) -> None:
    """The rule multiplies each kernel's inputs by the cell's own masks: one for every gate,
    or one per gate (`implementation=1`, which recurrent dropout selects)."""
    monkeypatch.setattr(DropoutRNNCell, "_create_dropout_mask", fixed_dropout_mask)
    inputs = keras.Input((LENGTH, 4))
    heads = [
        L.LSTM(3, dropout=0.3, recurrent_dropout=0.2, go_backwards=True)(inputs),
        L.GRU(3, dropout=0.3, recurrent_dropout=0.2)(inputs),
        L.GRU(3, recurrent_dropout=0.2, reset_after=False)(inputs),
        L.SimpleRNN(3, dropout=0.3, recurrent_dropout=0.2)(inputs),
    ]
    model = compiled(kgt.GradientTrackingModel(inputs, L.Dense(3)(L.Concatenate()(heads))))
    x, y = rng.normal(size=(BATCH, LENGTH, 4)).astype("float32"), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


def test_each_direction_of_a_bidirectional_is_a_column_on_its_rule() -> None:
    model = compiled(bidirectional_stack(kgt.GradientTrackingModel))
    model(token_ids()[:1])
    rows = [line.split() for line in model.gradient_tracking_summary().splitlines()]
    lstms = [(row[1].rstrip("_0123456789"), row[-1]) for row in rows if "_lstm" in row[1]]
    assert lstms == [("forward_lstm", "rule:recurrent"), ("backward_lstm", "rule:recurrent")] * 2


class MinimalCell(L.Layer):
    """keras.io's custom RNN cell (`keras.layers.RNN` guide)."""

    def __init__(self, units: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units

    def build(self, input_shape: Any) -> None:
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.recurrent_kernel = self.add_weight(shape=(self.units, self.units), name="recurrent")

    def call(self, inputs: Any, states: Any) -> Any:
        output = keras.ops.matmul(inputs, self.kernel)
        output = output + keras.ops.matmul(states[0], self.recurrent_kernel)
        return output, [output]


class OwnLSTM(L.LSTM):
    def call(
        self, sequences: Any, initial_state: Any = None, mask: Any = None, training: Any = False
    ) -> Any:
        return super().call(sequences, initial_state, mask, training)


def partly_frozen_lstm() -> Any:
    layer = L.LSTM(3)
    layer.build((None, LENGTH, 4))
    layer.cell.recurrent_kernel.trainable = False
    return layer


# name -> a recurrent layer off the rule, on (LENGTH, 4) inputs (ConvLSTM1D: (LENGTH, 4, 1))
OFF_THE_RULE: dict[str, Callable[[], Any]] = {
    "custom_cell": lambda: L.RNN(MinimalCell(3)),
    "own_call": lambda: OwnLSTM(3),
    "stacked_cells": lambda: L.RNN([L.LSTMCell(3), L.GRUCell(2)]),
    "conv_lstm": lambda: L.ConvLSTM1D(2, 2),
    "partly_frozen": partly_frozen_lstm,
}


def off_the_rule_model(model_class: type, name: str, masked: bool = False) -> Any:
    """The layer `name` of `OFF_THE_RULE` between inputs and a Dense head; `masked`:
    behind a `Masking` layer, so that its call receives a mask."""
    layer = OFF_THE_RULE[name]()
    inputs = keras.Input((LENGTH, 4, 1) if isinstance(layer, L.ConvLSTM1D) else (LENGTH, 4))
    hidden = layer(L.Masking()(inputs) if masked else inputs)
    return model_class(inputs, L.Dense(3)(L.Flatten()(hidden)))


def off_the_rule_inputs(model: Any, masked: bool = False) -> np.ndarray:
    x = rng.normal(size=(BATCH, *model.inputs[0].shape[1:])).astype("float32")
    if masked:  # trailing masked steps of different lengths
        for i in range(BATCH):
            x[i, LENGTH - i % 4 :] = 0.0
    return x


@pytest.mark.parametrize("name", sorted(OFF_THE_RULE))
def test_recurrent_layers_off_the_rule_run_on_the_fallback_exactly(name: str) -> None:
    """A cell of one's own (keras.io's RNN guide), a class overriding `call`, stacked
    cells, ConvLSTM and a partly frozen cell: the per-layer fallback, exact."""
    masked = name in ("custom_cell", "stacked_cells")
    model = compiled(off_the_rule_model(kgt.GradientTrackingModel, name, masked))
    x, y = off_the_rule_inputs(model, masked), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = oracle_statistics(model, x, y)  # before the tracked step trains
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
    recurrent = next(layer for layer in model.layers if isinstance(layer, L.RNN))
    summary = model.gradient_tracking_summary()
    line = next(line for line in summary.splitlines() if f" {recurrent.name} " in line)
    assert line.endswith(FALLBACK_PATH), summary


@pytest.mark.parametrize("name", ["custom_cell", "stacked_cells"])
def test_a_tracked_step_off_the_rule_trains_as_keras_does(name: str) -> None:
    build = lambda c: off_the_rule_model(c, name, masked=True)  # noqa: E731
    tracked, plain = compiled(build(kgt.GradientTrackingModel)), compiled(build(keras.Model))
    x = np.concatenate([off_the_rule_inputs(tracked, True), off_the_rule_inputs(tracked, True)])
    assert_trains_as_plain(tracked, plain, x, rng.integers(0, 3, 2 * BATCH), BATCH)


def test_states_returned_off_the_rule_are_probed_beside_the_output() -> None:
    """Stacked cells returning their states (the LSTM cell's two, the GRU cell's one),
    all read by the head: one probe on the output and states side by side."""
    inputs = keras.Input((LENGTH, 4))
    output, *states = L.RNN([L.LSTMCell(3), L.GRUCell(2)], return_state=True)(L.Masking()(inputs))
    head = L.Dense(3)(L.Concatenate()([output, *keras.tree.flatten(states)]))
    model = compiled(kgt.GradientTrackingModel(inputs, head))
    x, y = off_the_rule_inputs(model, masked=True), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (L.RNN(MinimalCell(3), stateful=True), "stateful=True"),
        (L.RNN([L.LSTMCell(3, dropout=0.2), L.GRUCell(2)]), r"dropout in its cell \(LSTMCell"),
    ],
)
def test_what_the_fallback_cannot_track_is_refused_before_training(layer: Any, match: str) -> None:
    inputs = keras.Input((LENGTH, 4), batch_size=BATCH)
    hidden = layer(inputs)
    model = compiled(kgt.GradientTrackingModel(inputs, L.Dense(3)(L.Flatten()(hidden))))
    x = rng.normal(size=(BATCH, *inputs.shape[1:])).astype("float32")
    model(x[:1] if not getattr(layer, "stateful", False) else x)
    before = model.get_weights()
    model.gradient_tracking.subscribe("test", statistics.resolve(None), 1, lambda r: None)
    with pytest.raises(ValueError, match=f"{layer.name}.*{match}.*second run differs"):
        model.fit(x, rng.integers(0, 3, BATCH), batch_size=BATCH, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
