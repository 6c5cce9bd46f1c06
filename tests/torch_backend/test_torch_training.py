"""The PyTorch engine in `fit`: a tracked step trains exactly as Keras' own torch step,
the log is the one `gradient_statistics` gives, and what the engine cannot track yet is
refused before any weight changes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest
import torch
from backend_models import MODELS, compiled
from backend_oracle import assert_trains_as_plain, tracked_statistics
from test_torch_oracle import BATCH, BUILDERS, data
from torch_oracle import assert_matches_oracle, oracle_statistics

import keras_gradtrack as kgt

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_tracked_step_trains_as_keras_does(name: str) -> None:
    build, _ = BUILDERS[name]
    x, y = data(name, seed=5)
    x, y = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])
    tracked, plain = compiled(build(kgt.GradientTrackingModel)), compiled(build(keras.Model))
    assert_trains_as_plain(tracked, plain, x, y, BATCH)
    assert tracked.gradient_tracking.step == 2


def test_the_opt_in_statistics_match_the_oracle() -> None:
    model = compiled(MODELS["cnn"][0](kgt.GradientTrackingModel))
    x, y = data("cnn", seed=6)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    batch = keras.ops.convert_to_tensor(x)
    norms = []
    for i in range(BATCH):
        xi = batch[i : i + 1].clone().requires_grad_(True)
        loss = model.loss(keras.ops.convert_to_tensor(y[i : i + 1]), model(xi, training=True))
        (grad,) = torch.autograd.grad(loss, [xi])
        norms.append(float(grad.norm()))
    got = tracked_statistics(model, x, y, names=["pairwise_cosine", "input_grad_norm"])
    assert_matches_oracle({"pairwise_cosine": got["pairwise_cosine"]}, expected)
    np.testing.assert_allclose(got["input_grad_norm"], norms, rtol=1e-4, atol=1e-7)


def test_the_log_holds_the_steps_statistics_and_ids(tmp_path: Path) -> None:
    model = compiled(MODELS["mlp"][0](kgt.GradientTrackingModel))
    x, y = data("mlp", seed=7)
    model(x[:1])
    expected = model.gradient_statistics(x[:3], y[:3])
    ids = np.arange(100, 100 + BATCH)
    path = tmp_path / "run.h5"
    model.fit(
        {"x": x, "example_id": ids},
        y,
        batch_size=3,
        shuffle=False,
        verbose=0,
        callbacks=[kgt.HDF5GradientLogger(path)],
    )
    log = kgt.GradientLog(path)
    assert log.attrs["backend"] == "torch"
    np.testing.assert_array_equal(log.per_example("example_id"), ids)
    first = log.per_example("grad_norm")[:3]
    np.testing.assert_allclose(first, expected["grad_norm"], rtol=1e-5)
    assert model.gradient_tracking.step == 2


def batch_normalization() -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    return kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))


def mixing() -> Any:
    """Subtracts the batch's mean: each example's output depends on the others."""
    inputs = keras.Input((6,))
    centered = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0))(inputs)
    return kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(centered))


def activity_regularized() -> Any:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activity_regularizer="l2")(inputs)
    return kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(hidden))


REFUSED = {
    "activity_regularizer": (activity_regularized, (6,), "activity regularizer"),
    "batch_normalization": (batch_normalization, (6,), "BatchNormalization"),
    "mixing": (mixing, (6,), "mixes the examples"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_tracked_yet_is_refused_before_any_weight_changes(
    name: str, tmp_path: Path
) -> None:
    build, shape, words = REFUSED[name]
    model = build()
    if getattr(model, "optimizer", None) is None:
        compiled(model)
    x = np.random.default_rng(8).normal(size=(BATCH, *shape)).astype("float32")
    y = np.zeros(BATCH, "int64")
    model(x[:1])
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError, match=words):
        model.fit(
            x, y, batch_size=3, verbose=0, callbacks=[kgt.HDF5GradientLogger(tmp_path / "r.h5")]
        )
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def scaled_run(tmp_path: Path, name: str, scale: float | None, private: bool) -> Any:
    """One step of the MLP (same weights and data every call), with the optimizer's
    `loss_scale_factor`: `(its log, its weights after)`."""
    keras.utils.set_random_seed(3)
    model = MODELS["mlp"][0](kgt.GradientTrackingModel)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5, loss_scale_factor=scale),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    if private:
        model.make_private(l2_norm_clip=0.05, noise_multiplier=0.0)
    x = np.random.default_rng(0).normal(size=(8, *MODELS["mlp"][1])).astype("float32")
    y = np.arange(8) % 3
    path = tmp_path / f"{name}.h5"
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[kgt.HDF5GradientLogger(path)])
    return kgt.GradientLog(path), model.get_weights()


@pytest.mark.parametrize("private", [False, True])
def test_a_loss_scale_factor_changes_neither_the_statistics_nor_the_update(
    tmp_path: Path, private: bool
) -> None:
    # The optimizer scales the loss by s and unscales the gradients it receives: the
    # statistics are the unscaled loss's, and (clipped, when private) the update too.
    plain_log, plain_weights = scaled_run(tmp_path, "plain", None, private)
    scaled_log, scaled_weights = scaled_run(tmp_path, "scaled", 1000.0, private)
    for name in ("grad_norm", "cosine", "loss"):
        np.testing.assert_allclose(
            scaled_log.per_example(name), plain_log.per_example(name), rtol=1e-5
        )
    for got, want in zip(scaled_weights, plain_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if private:
        assert plain_log.per_step("dp_fraction_clipped")[0] > 0.5  # the clipping acts


SCRIPT = """
import sys
import keras, numpy as np
import keras_gradtrack as kgt
inputs = keras.Input((4,))
model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(2)(inputs))
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((6, 4), "float32"), np.zeros((6, 2), "float32")
model.fit(x, y, batch_size=3, verbose=0, callbacks=[kgt.HDF5GradientLogger(sys.argv[1])])
log = kgt.GradientLog(sys.argv[1])
print(log.num_examples, log.attrs["backend"], "tensorflow" in sys.modules)
"""


def test_the_engine_imports_no_tensorflow(tmp_path: Path) -> None:
    env = {"KERAS_BACKEND": "torch", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "run.h5")],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience.seconds(2),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["6", "torch", "False"]


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io's layer, as written there: the position table called on
    `ops.arange(maxlen)`, a value without the batch's rows."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        maxlen = keras.ops.shape(x)[-1]
        positions = self.pos_emb(keras.ops.arange(start=0, stop=maxlen, step=1))
        return self.token_emb(x) + positions


def positions_model(model_class: type, length: int) -> Any:
    inputs = keras.Input((length,), dtype="int32")
    hidden = TokenAndPositionEmbedding(length, 7, 4)(inputs)
    return compiled(model_class(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden))))


@pytest.mark.parametrize("length", [BATCH, BATCH + 1])
def test_a_position_table_is_exact_whatever_its_length(length: int) -> None:
    """The position table's call has no batch axis: with `length == batch size` a
    per-example reading of its output would be silently wrong, any other length a shape
    error; broadcast to the batch, each example's gradient is exact."""
    model = positions_model(kgt.GradientTrackingModel, length)
    rng = np.random.default_rng(9)
    x, y = rng.integers(0, 7, (BATCH, length)).astype("int32"), rng.integers(0, 3, BATCH)
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    assert_matches_oracle(tracked_statistics(model, x, y), expected)
    plain = positions_model(keras.Model, length)
    x2, y2 = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])
    assert_trains_as_plain(positions_model(kgt.GradientTrackingModel, length), plain, x2, y2, BATCH)


def test_gradient_statistics_searches_batchless_calls_once_per_shape(monkeypatch: Any) -> None:
    """The search (two inference passes) runs once per input shape; each call is exact."""
    from keras_gradtrack.backends.torch import mixin

    searches: list[int] = []
    search = mixin.find_batchless_calls
    monkeypatch.setattr(mixin, "find_batchless_calls", lambda *a: searches.append(1) or search(*a))
    model = positions_model(kgt.GradientTrackingModel, BATCH)
    rng = np.random.default_rng(10)
    x, y = rng.integers(0, 7, (BATCH, BATCH)).astype("int32"), rng.integers(0, 3, BATCH)
    model(x[:1])
    names = ["loss", "grad_norm", "cosine", "layer_grad_norm"]
    for rows in (BATCH, BATCH, BATCH - 1, BATCH):
        expected = oracle_statistics(model, x[:rows], y[:rows])
        got = model.gradient_statistics(x[:rows], y[:rows], statistics=names)
        assert_matches_oracle(got, {name: expected[name] for name in names})
    assert len(searches) == 2


# Dynamo reads `.grad` of Keras' metric tensors while compiling Keras' own step (not
# this library's code): a UserWarning, which this suite otherwise turns into an error.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_jit_compile_runs_keras_compiled_step_untracked_and_the_tracked_step_exact() -> None:
    """`jit_compile=True`: Keras' `torch.compile`d step runs the untracked steps, the
    tracked ones run eagerly (the probes patch the layers' calls), exact against the
    oracle; the model trains as plain Keras compiled the same way."""
    build, _ = BUILDERS["mlp"]
    x, y = data("mlp", seed=11)
    x, y = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])

    def jit_compiled(model: Any) -> Any:
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=True,
        )
        return model

    tracked, plain = (
        jit_compiled(build(kgt.GradientTrackingModel)),
        jit_compiled(build(keras.Model)),
    )
    assert_trains_as_plain(tracked, plain, x, y, BATCH)
    assert tracked.jit_compile and plain.jit_compile
    expected = oracle_statistics(tracked, x[:BATCH], y[:BATCH])
    assert_matches_oracle(tracked_statistics(tracked, x[:BATCH], y[:BATCH]), expected)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_the_summary_says_the_tracked_steps_run_eagerly_under_jit_compile(
    jit_compile: bool,
) -> None:
    """Not compiled where Keras compiles its step: said, not silent."""
    build, _ = BUILDERS["mlp"]
    model = build(kgt.GradientTrackingModel)
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    text = model.gradient_tracking_summary(print_fn=lambda _: None)
    said = "the tracked steps run eagerly" in text
    assert said == jit_compile, text
    # The table's rows come first, one per tracked layer, as without the note.
    rows = text.splitlines()[2 : 2 + len(model.gradient_tracking_plan())]
    assert all(row.split()[0].isdigit() for row in rows), text
