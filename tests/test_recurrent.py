"""Recurrent layers against the per-example oracle, and their outputs against Keras'.

The grid crosses every cell with sequence lengths 1, 7 and 64; at length 7 each
model holds one branch per row of `ROWS`, where every pair of (direction,
masking, return_sequences) settings appears (a strength-2 covering array: each
recurrent layer costs seconds of tracing, and the oracle's eager loop more at
length 64, so the full product would take many minutes). The Bidirectional
rows take each merge mode across the cells. Every case also checks that the
layers under test took the recurrent rule, so a rule that silently stops
applying fails here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell
from oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt
from keras_gradtrack.engine.tracked_layer import FALLBACK_PATH
from keras_gradtrack.rules import RECURRENT

rng = np.random.default_rng(17)
L = keras.layers
BATCH = 4
RULE = "rule:recurrent"

CELLS: dict[str, Callable[..., Any]] = {
    "simple_rnn": L.SimpleRNN,
    "lstm": L.LSTM,
    "gru": L.GRU,
    "gru_reset_before": functools.partial(L.GRU, reset_after=False),
}
MERGE_MODES = ("concat", "sum", "ave", "mul", None)

# (direction, masked, return_sequences): every pair of a direction (forward, backward),
# a masking and a return_sequences setting appears in some row; a Bidirectional runs both
# directions (and sets zero_output_for_mask to return_sequences).
ROWS = [
    ("bidirectional", True, True),
    ("bidirectional", False, False),
    ("forward", True, False),
    ("backward", False, True),
]
ROWS_BY_LENGTH = {1: ROWS[:1], 7: ROWS, 64: [("forward", True, True)]}


def sparse_ce() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(inputs: Any, outputs: Any, loss: Any = None, **kwargs: Any) -> Any:
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(optimizer="sgd", loss=loss or sparse_ce(), **kwargs)
    return model


def sequences(length: int, features: int = 2, batch: int = BATCH) -> np.ndarray:
    """Random sequences with zero steps (masked by `Masking`) anywhere but in example 0;
    every example keeps one step (a wholly masked example's average pooling is 0/0)."""
    x = rng.normal(size=(batch, length, features)).astype("float32")
    dropped = rng.random((batch, length)) < 0.35
    dropped[0] = False
    dropped[np.arange(batch), rng.integers(0, length, batch)] = False
    x[dropped] = 0.0
    return x


def pooled(output: Any) -> Any:
    """A sequence output averaged over its (unmasked) steps; a merge_mode=None pair joined."""
    if isinstance(output, (list, tuple)):
        output = L.Concatenate()([pooled(part) for part in output])
    return L.GlobalAveragePooling1D()(output) if len(output.shape) == 3 else output


def branch(cell: str, direction: str, return_sequences: bool, merge_mode: Any) -> Any:
    layer = CELLS[cell](2, return_sequences=return_sequences, go_backwards=direction == "backward")
    if direction == "bidirectional":
        return L.Bidirectional(layer, merge_mode=merge_mode)
    return layer


def assert_paths(model: Any, expected: dict[type, str]) -> None:
    for tracked in model.gradient_tracking_plan():
        for layer_class, path in expected.items():
            if isinstance(tracked.layer, layer_class):
                assert tracked.path == path, (tracked.name, tracked.path, tracked.reason)


def assert_exact(model: Any, x: Any, y: Any, sample_weight: Any = None, **kwargs: Any) -> None:
    expected = oracle_statistics(model, x, y, sample_weight)
    assert_matches_oracle(model.gradient_statistics(x, y, sample_weight, **kwargs), expected)


@pytest.mark.parametrize(
    "length",
    # 64 steps take the paths of 7, longer (make test-all).
    [
        1,
        pytest.param(7, marks=pytest.mark.slow),
        pytest.param(64, marks=[pytest.mark.slow, pytest.mark.extended]),
    ],
)
@pytest.mark.parametrize("cell", list(CELLS))
def test_every_cell_direction_masking_and_output_matches_the_oracle(cell: str, length: int) -> None:
    inputs = keras.Input((length, 2))
    masked = L.Masking()(inputs)
    modes = iter(MERGE_MODES[list(CELLS).index(cell) * 2 :] + MERGE_MODES)
    heads = []
    for direction, is_masked, return_sequences in ROWS_BY_LENGTH[length]:
        merge_mode = next(modes) if direction == "bidirectional" else None
        layer = branch(cell, direction, return_sequences, merge_mode)
        heads.append(pooled(layer(masked if is_masked else inputs)))
    outputs = L.Dense(2)(L.Concatenate()(heads) if len(heads) > 1 else heads[0])
    model = compiled(inputs, outputs)
    batch = 2 if length == 64 else BATCH  # the oracle's eager loop is slow
    assert_exact(model, sequences(length, batch=batch), rng.integers(0, 2, batch))
    assert_paths(model, {L.RNN: RULE})


@pytest.mark.slow
def test_keras_io_bidirectional_lstm_imdb_pattern() -> None:
    """keras-io `bidirectional_lstm_imdb`: Embedding, two stacked Bidirectional(LSTM)."""
    inputs = keras.Input((None,), dtype="int32")
    hidden = L.Embedding(20, 4)(inputs)
    hidden = L.Bidirectional(L.LSTM(3, return_sequences=True))(hidden)
    hidden = L.Bidirectional(L.LSTM(3))(hidden)
    outputs = L.Dense(1, activation="sigmoid")(hidden)
    model = compiled(inputs, outputs, "binary_crossentropy")
    x = rng.integers(1, 20, (BATCH, 9))
    x[1, :4] = 0  # pad_sequences pads at the front
    assert_exact(model, x, rng.integers(0, 2, (BATCH, 1)).astype("float32"))
    # Each direction of a Bidirectional is a column of its own.
    names = [name.rstrip("_0123456789") for name in model.tracked_layer_names]
    assert names == ["embedding", *["forward_lstm", "backward_lstm"] * 2, "dense"]
    assert_paths(model, {L.LSTM: RULE})


def test_keras_io_weather_forecasting_pattern_with_sample_weights() -> None:
    """keras-io `timeseries_weather_forecasting`: LSTM then Dense(1), mean squared error."""
    inputs = keras.Input((12, 3))
    outputs = L.Dense(1)(L.LSTM(4)(inputs))
    model = compiled(inputs, outputs, "mse")
    x = rng.normal(size=(5, 12, 3)).astype("float32")
    weights = rng.uniform(0.0, 2.0, 5)
    assert_exact(model, x, rng.normal(size=(5, 1)), weights)


def test_multi_input_multi_output_model_with_lstms_and_loss_weights() -> None:
    """The Keras functional-API guide's ticket model: two texts (one padded and masked)
    through LSTMs, tags, two outputs with loss weights."""
    title = keras.Input((None,), dtype="int32", name="title")
    body = keras.Input((None,), dtype="int32", name="body")
    tags = keras.Input((3,), name="tags")
    title_features = L.LSTM(4)(L.Embedding(30, 3)(title))
    body_features = L.GRU(3)(L.Embedding(30, 3, mask_zero=True)(body))
    merged = L.Concatenate()([title_features, body_features, tags])
    priority = L.Dense(1, name="priority")(merged)
    department = L.Dense(4, name="department")(merged)
    model = kgt.GradientTrackingModel([title, body, tags], [priority, department])
    model.compile(
        optimizer="sgd",
        loss=[
            keras.losses.BinaryCrossentropy(from_logits=True),
            keras.losses.CategoricalCrossentropy(from_logits=True),
        ],
        loss_weights=[1.0, 0.2],
    )
    body_ids = rng.integers(1, 30, (BATCH, 8))
    body_ids[0, 5:] = 0
    body_ids[2, 2:] = 0
    x = {
        "title": rng.integers(0, 30, (BATCH, 5)),
        "body": body_ids,
        "tags": rng.integers(0, 2, (BATCH, 3)).astype("float32"),
    }
    y = [
        rng.integers(0, 2, (BATCH, 1)).astype("float32"),
        np.eye(4)[rng.integers(0, 4, BATCH)].astype("float32"),
    ]
    assert_exact(model, x, y)
    assert_paths(model, {L.LSTM: RULE, L.GRU: RULE})


def test_direct_form_and_pairwise_cosine() -> None:
    """Short sequences of wide layers take the Gram form `Σ_{t,s} (a_t·a_s)(δ_t·δ_s)`."""
    inputs = keras.Input((2, 12))
    hidden = L.GRU(12, return_sequences=True, reset_after=False)(L.Masking()(inputs))
    outputs = L.Dense(2)(L.LSTM(12, go_backwards=True)(hidden))
    model = compiled(inputs, outputs)
    x, y = sequences(2, 12), rng.integers(0, 2, BATCH)
    assert_exact(model, x, y)
    assert list(model.gradient_tracking.forms.values()) == ["direct"] * 3
    assert_exact(model, x, y, statistics=["pairwise_cosine", "cosine"])


def test_unroll_uses_the_same_rule() -> None:
    inputs = keras.Input((5, 2))
    hidden = L.Bidirectional(L.LSTM(3, unroll=True))(L.Masking()(inputs))
    sequence = L.GRU(2, return_sequences=True, go_backwards=True, unroll=True)(inputs)
    outputs = L.Dense(2)(L.Concatenate()([hidden, L.Flatten()(sequence)]))
    model = compiled(inputs, outputs)
    assert_exact(model, sequences(5), rng.integers(0, 2, BATCH))
    assert_paths(model, {L.RNN: RULE})


def test_returned_states_initial_states_and_a_shared_layer() -> None:
    """An encoder's states start a decoder; one LSTM reads two inputs (its calls add up)."""
    source, target = keras.Input((6, 2)), keras.Input((4, 2))
    _, state_h, state_c = L.LSTM(3, return_state=True)(source)
    decoded = L.LSTM(3, return_sequences=True)(target, initial_state=[state_h, state_c])
    shared = L.SimpleRNN(2)
    pair = L.Concatenate()([shared(source), shared(L.Masking()(target))])
    outputs = L.Dense(2)(L.Concatenate()([L.Flatten()(decoded), pair, state_c]))
    model = compiled([source, target], outputs)
    x = [sequences(6), sequences(4)]
    assert_exact(model, x, rng.integers(0, 2, BATCH))
    assert_paths(model, {L.RNN: RULE})


def fixed_dropout_mask(self: Any, step_input: Any, dropout_rate: float) -> Any:
    """A dropout mask that is the same for every example and differs per gate, so the
    oracle's one-example batches see the batch's masks."""
    width = step_input.shape[-1]

    def mask(gate: int) -> Any:
        keep = (np.arange(width) + gate) % 3 != 0
        return tf.ones_like(step_input) * (keep / (1.0 - dropout_rate)).astype("float32")

    count = getattr(self, "dropout_mask_count", None)
    return mask(0) if count is None else [mask(gate) for gate in range(count)]


@pytest.mark.slow
def test_dropout_and_recurrent_dropout_use_the_cells_masks(monkeypatch: Any) -> None:
    """The rule multiplies each kernel's inputs by the cell's own masks: one for every gate,
    or one per gate (`implementation=1`, which recurrent dropout selects)."""
    monkeypatch.setattr(DropoutRNNCell, "_create_dropout_mask", fixed_dropout_mask)
    inputs = keras.Input((5, 4))
    masked = L.Masking()(inputs)
    heads = [
        L.LSTM(3, dropout=0.3)(masked),
        L.LSTM(3, dropout=0.3, recurrent_dropout=0.2, go_backwards=True)(inputs),
        L.GRU(3, dropout=0.3, recurrent_dropout=0.2)(masked),
        L.GRU(3, recurrent_dropout=0.2, reset_after=False)(inputs),
        L.SimpleRNN(3, dropout=0.3, recurrent_dropout=0.2)(masked),
    ]
    model = compiled(inputs, L.Dense(2)(L.Concatenate()(heads)))
    assert_exact(model, sequences(5, 4), rng.integers(0, 2, BATCH))
    assert_paths(model, {L.RNN: RULE})


class MinimalCell(keras.layers.Layer):
    """The cell of Keras' RNN docstring; its `call` returns `h, [h]`."""

    def __init__(self, units: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.units = self.state_size = units

    def build(self, input_shape: Any) -> None:
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.recurrent_kernel = self.add_weight(shape=(self.units, self.units), name="recurrent")

    def call(self, inputs: Any, states: Any) -> Any:
        h = keras.ops.tanh(inputs @ self.kernel + states[0] @ self.recurrent_kernel)
        return h, [h]


@pytest.mark.slow
def test_other_recurrent_layers_run_on_the_fallback_whole_and_exactly() -> None:
    """A user's cell (stacked cells alike): the layer is one column, on the fallback (a
    Jacobian through the loop, no unroll needed); its returned state is its output."""
    inputs = keras.Input((5, 2))
    output, state = L.RNN(MinimalCell(3), return_state=True)(L.Masking()(inputs))
    model = compiled(inputs, L.Dense(2)(L.Concatenate()([output, state])))
    assert_exact(model, sequences(5), rng.integers(0, 2, BATCH))
    plan = model.gradient_tracking_plan()
    assert [type(tracked.layer) for tracked in plan] == [L.RNN, L.Dense]
    assert plan[0].path == FALLBACK_PATH and plan[0].num_parameters == 15


@pytest.mark.slow
def test_conv_lstm_runs_on_the_fallback_and_is_exact() -> None:
    inputs = keras.Input((3, 4, 2))
    hidden = L.ConvLSTM1D(2, 2, return_sequences=True)(inputs)
    model = compiled(inputs, L.Dense(2)(L.Flatten()(hidden)))
    assert_exact(model, rng.normal(size=(3, 3, 4, 2)).astype("float32"), rng.integers(0, 2, 3))
    plan = model.gradient_tracking_plan()
    assert plan[0].name == "conv_lstm1d" and plan[0].path == FALLBACK_PATH
    assert "ConvLSTM overrides the call()" in plan[0].reason


@pytest.mark.parametrize(
    "layer, option",
    [
        (lambda: L.RNN(MinimalCell(2), stateful=True), "stateful=True"),
        (lambda: L.RNN([L.LSTMCell(2, dropout=0.2)]), r"dropout in its cell \(LSTMCell"),
    ],
    ids=["stateful", "dropout"],
)
def test_the_fallback_refuses_a_call_it_cannot_repeat(layer: Any, option: str) -> None:
    inputs = keras.Input((4, 2), batch_size=BATCH)
    model = compiled(inputs, L.Dense(2)(layer()(inputs)))
    with pytest.raises(ValueError, match=f"no rule .*with {option}.* that second run differs"):
        model.gradient_tracking_plan()


# -- the tracked call is Keras' call ----------------------------------------------

OPTIONS = [
    {},
    {"return_sequences": True, "go_backwards": True},
    {"return_state": True},
    {"return_sequences": True, "return_state": True, "zero_output_for_mask": True},
    {"return_sequences": True, "unroll": True, "go_backwards": True},
]


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda options: "-".join(options) or "default")
@pytest.mark.parametrize("cell", list(CELLS))
def test_the_tracked_call_returns_keras_outputs(cell: str, options: dict, masked: bool) -> None:
    layer = CELLS[cell](3, **options)
    x = tf.constant(sequences(5, 2))
    mask = tf.reduce_any(x != 0.0, axis=-1) if masked else None
    initial_state = [tf.constant(rng.normal(size=(BATCH, 3)), tf.float32)] * (
        2 if cell == "lstm" else 1
    )
    kwargs = {"mask": mask, "initial_state": initial_state, "training": True}
    expected = layer(x, **kwargs)
    actual = RECURRENT.tap(layer, layer.call, (x,), kwargs).outputs
    for want, got in zip(keras.tree.flatten(expected), keras.tree.flatten(actual)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "inner_loop" not in layer.__dict__  # the layer's own loop again


def test_on_a_gpu_masked_steps_are_zero_as_cudnn_makes_them(monkeypatch: Any) -> None:
    """Where Keras would run cuDNN, the tracked loop follows cuDNN's output for masked
    steps (zero, whatever `zero_output_for_mask` says). There is no GPU here: the test
    says there is one, and compares with the generic loop set to zeros."""
    x = tf.constant(sequences(5, 2))
    mask = tf.reduce_any(x != 0.0, axis=-1)
    for cell in ("lstm", "gru"):
        layer = CELLS[cell](3, return_sequences=True)
        zeroed = CELLS[cell](3, return_sequences=True, zero_output_for_mask=True)
        layer(x), zeroed(x)
        zeroed.set_weights(layer.get_weights())
        expected = zeroed(x, mask=mask)
        generic = RECURRENT.tap(layer, layer.call, (x,), {"mask": mask}).outputs
        with monkeypatch.context() as patch:
            patch.setattr(
                sys.modules["keras.src.backend.tensorflow.rnn"], "_is_gpu_available", lambda: True
            )
            actual = RECURRENT.tap(layer, layer.call, (x,), {"mask": mask}).outputs
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
        assert np.any(generic.numpy()[~mask.numpy()] != 0)  # the generic loop repeats outputs


# -- training --------------------------------------------------------------------


def small_recurrent_model(model_class: type = kgt.GradientTrackingModel) -> Any:
    inputs = keras.Input((6, 2))
    outputs = L.Dense(3)(L.GRU(3)(L.Masking()(inputs)))
    model = model_class(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=sparse_ce())
    return model


@pytest.mark.slow
def test_updates_equal_plain_keras_and_each_logged_step_matches_the_oracle(
    tmp_path: Path,
) -> None:
    """Batches of 4, 4 and 2 (one trace for both batch sizes): the weights follow plain
    Keras, and each step's rows are the oracle's at the weights before that step."""
    x, y = sequences(6, batch=10), rng.integers(0, 3, 10)
    plain, tracked = small_recurrent_model(keras.Model), small_recurrent_model()
    tracked.set_weights(plain.get_weights())
    expected = []

    class Oracle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rows = slice(batch * 4, batch * 4 + 4)
            expected.append(oracle_statistics(tracked, x[rows], y[rows]))

    fit_args = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, **fit_args)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5")
    tracked.fit(x, y, callbacks=[Oracle(), logger], **fit_args)
    for actual, want in zip(tracked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-5)
    with kgt.GradientLog(tmp_path / "run.h5") as log:
        assert log.per_step("batch_size").tolist() == [4, 4, 2]
        steps = log.per_example("step")
        for step, oracle in enumerate(expected):
            logged = {name: log.per_example(name)[steps == step] for name in log.per_example_names}
            logged.update({name: log.per_step(name)[step] for name in log.per_step_names})
            assert_matches_oracle(logged, oracle)


def test_a_stateful_layer_carries_its_states_as_in_plain_keras(tmp_path: Path) -> None:
    def build(model_class: type) -> Any:
        inputs = keras.Input((5, 2), batch_size=BATCH)
        outputs = L.Dense(2)(L.GRU(3, stateful=True, name="gru")(inputs))
        model = model_class(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
        return model

    plain, tracked = build(keras.Model), build(kgt.GradientTrackingModel)
    tracked.set_weights(plain.get_weights())
    x, y = sequences(5, batch=3 * BATCH), rng.normal(size=(3 * BATCH, 2))
    fit_args = dict(batch_size=BATCH, shuffle=False, verbose=0)
    plain.fit(x, y, **fit_args)
    tracked.fit(x, y, callbacks=[kgt.HDF5GradientLogger(tmp_path / "run.h5")], **fit_args)
    for want, got in zip(plain.get_layer("gru").states, tracked.get_layer("gru").states):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    for actual, want in zip(tracked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_mixed_precision_float16_sequences_leave_the_loop_unchanged(cell: str) -> None:
    """The loop emits `h_{t-1}` (and a GRU's reset gate) as their bits; under
    mixed_float16 they are 16 bits wide and must come back as float16."""
    x, y = sequences(6), rng.integers(0, 2, BATCH)

    def build() -> Any:
        inputs = keras.Input((6, 2))
        hidden = CELLS[cell](4, return_sequences=True)(inputs)
        outputs = L.Dense(2, dtype="float32")(CELLS[cell](3)(hidden))
        return compiled(inputs, outputs)

    reference = build()
    expected = oracle_statistics(reference, x, y)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build()
        model.set_weights(reference.get_weights())
        stats = model.gradient_statistics(x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_paths(model, {L.RNN: RULE})
    # float16 keeps 11 significant bits (tests/test_mixed_precision.py's tolerance).
    for name in ("loss", "grad_norm", "layer_grad_norm"):
        np.testing.assert_allclose(stats[name], expected[name], rtol=5e-3, err_msg=name)
