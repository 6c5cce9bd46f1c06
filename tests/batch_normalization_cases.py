"""BatchNormalization in training on a probed engine (JAX, PyTorch), opted in: exact
through the batch statistics; each backend's test module imports these.

`g_i = d l_i / d theta` holds the other examples fixed (the TensorFlow engine's
definition); the oracle is the backend's own: each example's loss on its row of the
full batch's forward pass, differentiated (`oracle_statistics(..., full_batch=True)`:
`jax.jacrev`, `torch.autograd.grad` per example). The model builders run on
TensorFlow too (`test_tensorflow_gives_the_same_numbers`).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import keras
import numpy as np
import patience
import pytest
from backend_oracle import assert_trains_as_plain, replayed_draws, tracked_statistics
from tolerance import assert_matches_oracle

import keras_gradtrack as kgt

layers = keras.layers


def oracle_statistics(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return importlib.import_module(f"{keras.backend.backend()}_oracle").oracle_statistics(
        *args, **kwargs
    )


def per_example_gradients(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return importlib.import_module(f"{keras.backend.backend()}_oracle").per_example_gradients(
        *args, **kwargs
    )


ROOT = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(77)
X = rng.normal(size=(6, 8, 8, 2)).astype("float32")
Y = rng.integers(0, 3, 6)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_cnn(model_class: type = kgt.GradientTrackingModel) -> Any:
    """Two (Conv2D, BatchNormalization, ReLU) blocks, then a Dense head beside none."""
    inputs = keras.Input((8, 8, 2))
    hidden = inputs
    for block in range(2):
        hidden = layers.Conv2D(3, 3, padding="same", name=f"conv{block}")(hidden)
        hidden = layers.BatchNormalization(name=f"bn{block}")(hidden)
        hidden = layers.ReLU()(hidden)
    hidden = layers.GlobalAveragePooling2D()(hidden)
    return model_class(inputs, layers.Dense(3, name="head")(hidden))


def applications_block(model_class: type = kgt.GradientTrackingModel, dropout: float = 0.3) -> Any:
    """A keras.applications-style stem: Conv (no bias), BN, ReLU, pooling, dropout, a
    Dense head."""
    inputs = keras.Input((8, 8, 2))
    hidden = layers.Conv2D(4, 3, strides=2, padding="same", use_bias=False, name="stem_conv")(
        inputs
    )
    hidden = layers.BatchNormalization(axis=-1, epsilon=1.001e-5, name="stem_bn")(hidden)
    hidden = layers.Activation("relu", name="stem_relu")(hidden)
    hidden = layers.Conv2D(4, 1, use_bias=False, name="block_conv")(hidden)
    hidden = layers.BatchNormalization(momentum=0.9, name="block_bn")(hidden)
    hidden = layers.ReLU()(hidden)
    hidden = layers.GlobalAveragePooling2D(name="avg_pool")(hidden)
    hidden = layers.Dropout(dropout, name="top_dropout")(hidden)
    hidden = layers.Dense(5, activation="relu", name="fc")(hidden)
    return model_class(inputs, layers.Dense(3, name="predictions")(hidden))


def compiled(model: Any, loss: Any = LOSS, chunk_size: int | None = 4) -> Any:
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, metrics=["accuracy"])
    if chunk_size is not None:
        model.track_batch_normalization = True
        model.batch_normalization_chunk_size = chunk_size
    return model


def matches_full_batch_oracle(model: Any, x: Any = X, y: Any = Y, **kwargs: Any) -> dict:
    replay = replayed_draws()
    stats = model.gradient_statistics(x, y, **kwargs)
    replay()
    expected = oracle_statistics(model, x, y, kwargs.get("sample_weight"), full_batch=True)
    assert_matches_oracle(stats, expected)
    return stats


# 6 examples: chunks of 4 end with a partial one, a chunk of 8 holds them all.
# Chunks of one example each repeat chunks of four on the small CNN: `make test-all`.
@pytest.mark.parametrize(
    ("build", "chunk_size"),
    [
        pytest.param(small_cnn, 1, marks=pytest.mark.extended),
        (small_cnn, 4),
        (small_cnn, 8),
        (applications_block, 1),
        (applications_block, 4),
        (applications_block, 8),
    ],
)
def test_training_mode_matches_the_full_batch_oracle(build: Any, chunk_size: int) -> None:
    matches_full_batch_oracle(compiled(build(), chunk_size=chunk_size))


def test_sample_weights_and_a_summed_loss() -> None:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model = compiled(small_cnn(), loss=loss)
    weights = rng.uniform(0.5, 2.0, 6).astype("float32")
    matches_full_batch_oracle(model, sample_weight=weights)


def test_per_example_gradients_sum_to_the_batch_gradient() -> None:
    # With the other examples held fixed, sum_i g_i = G (a summed loss, no penalties).
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model = compiled(applications_block(), loss=loss)
    found = per_example_gradients(model, X, Y, full_batch=True)
    summed = np.concatenate(found["g"], axis=1).sum(axis=0)
    np.testing.assert_allclose(summed, np.concatenate(found["G"]), rtol=1e-4, atol=1e-6)
    matches_full_batch_oracle(model)


def test_a_regularized_dense_network_with_batch_normalization_on_another_axis() -> None:
    # G includes the penalty's gradient, the coupled g_i do not (as for every layer).
    inputs = keras.Input((6, 3))
    regularizer = keras.regularizers.L2(0.1)
    hidden = layers.Dense(4, kernel_regularizer=regularizer, name="dense")(inputs)
    hidden = layers.BatchNormalization(axis=1, name="bn_positions")(hidden)
    hidden = layers.Dense(4, activation="relu", name="dense2")(layers.Flatten()(hidden))
    hidden = layers.BatchNormalization(name="bn_features")(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    x = rng.normal(size=(5, 6, 3)).astype("float32")
    matches_full_batch_oracle(model, x, Y[:5])


def test_masked_positions_do_not_enter_the_moments() -> None:
    inputs = keras.Input((6,), dtype="int32")
    hidden = layers.Embedding(10, 4, mask_zero=True, name="embedding")(inputs)
    hidden = layers.Dense(4, name="dense")(hidden)
    hidden = layers.BatchNormalization(name="bn")(hidden)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    tokens = rng.integers(1, 10, (5, 6))
    tokens[:, 4:] = 0
    matches_full_batch_oracle(model, tokens, Y[:5])
    # The masked call's own gamma and beta are rows too (on TensorFlow: its rule).
    assert coupled_in_summary(model) == {"embedding", "dense", "bn"}


def test_batch_renormalization_is_coupled() -> None:
    # Renormalization's corrections multiply gamma: no rule, the layer's rows are taken.
    inputs = keras.Input((8, 8, 2))
    hidden = layers.Conv2D(3, 3, name="conv")(inputs)
    hidden = layers.BatchNormalization(renorm=True, name="renorm_bn")(hidden)
    hidden = layers.Conv2D(3, 3, activation="relu", name="conv2")(hidden)
    hidden = layers.BatchNormalization(name="bn")(hidden)
    hidden = layers.GlobalAveragePooling2D()(hidden)
    model = compiled(kgt.GradientTrackingModel(inputs, layers.Dense(3, name="head")(hidden)))
    model(X[:2], training=True)  # moves the renormalization statistics off their start
    matches_full_batch_oracle(model)
    assert coupled_in_summary(model) == {"conv", "renorm_bn", "conv2"}


class InferenceModeCall(kgt.GradientTrackingModel):
    """A trainable BatchNormalization that the model calls with training=False."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = layers.Conv2D(3, 3, name="conv")
        self.norm = layers.BatchNormalization(name="bn")
        self.head = layers.Dense(3, name="head")

    def call(self, x: Any, training: bool = False) -> Any:
        hidden = self.norm(self.conv(x), training=False)
        return self.head(keras.ops.mean(hidden, axis=(1, 2)))


def test_an_inference_mode_call_uses_the_moving_moments_and_couples_nothing() -> None:
    model = compiled(InferenceModeCall())
    model(X[:2])
    model.norm.moving_mean.assign(rng.normal(size=3).astype("float32"))
    model.norm.moving_variance.assign(rng.uniform(0.5, 2.0, 3).astype("float32"))
    stats = model.gradient_statistics(X, Y)
    assert_matches_oracle(stats, oracle_statistics(model, X, Y))
    assert coupled_in_summary(model) == set()


def coupled_in_summary(model: Any) -> set[str]:
    lines = model.gradient_tracking_summary(print_fn=lambda _: None).splitlines()[2:]
    return {line.split()[1] for line in lines if "coupled" in line}


def test_the_summary_names_the_coupled_layers_before_and_after_a_step() -> None:
    model = compiled(small_cnn())
    # As on TensorFlow: bn1's own gamma and beta and the head after it keep their rules.
    expected = {"conv0", "bn0", "conv1"}
    assert coupled_in_summary(model) == expected
    matches_full_batch_oracle(model)
    assert coupled_in_summary(model) == expected


def test_frozen_batch_normalization_couples_nothing() -> None:
    model = compiled(small_cnn())
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.trainable = False
    model.compile(optimizer="sgd", loss=LOSS)
    stats = model.gradient_statistics(X, Y)
    assert_matches_oracle(stats, oracle_statistics(model, X, Y))
    assert coupled_in_summary(model) == set()


@pytest.mark.parametrize("build", [small_cnn, applications_block])
def test_a_tracked_step_trains_as_keras_does(build: Any) -> None:
    # The same weights, moving statistics (non-trainable weights) and metrics.
    x = rng.normal(size=(12, 8, 8, 2)).astype("float32")
    y = rng.integers(0, 3, 12)
    # Built after the same seed: the dropout's seed state (not among the weights) too.
    keras.utils.set_random_seed(5)
    tracked = compiled(build())
    keras.utils.set_random_seed(5)
    plain = compiled(build(keras.Model), chunk_size=None)
    history = assert_trains_as_plain(tracked, plain, x, y, batch_size=6)
    assert "accuracy" in history
    moving = [v for v in tracked.non_trainable_variables if "moving" in v.path]
    assert moving and all(np.any(v.numpy() != 0) for v in moving)


def test_without_the_opt_in_the_refusal_names_it() -> None:
    model = compiled(small_cnn(), chunk_size=None)
    with pytest.raises(ValueError, match="track_batch_normalization = True"):
        model.gradient_statistics(X, Y)


class OwnLoss(kgt.GradientTrackingModel):
    """A `compute_loss` of the model's own (Keras' step records the losses it reduces)."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return super().compute_loss(*args, **kwargs)


def functional(model_class: type) -> Any:
    """The small CNN as a functional model of `model_class`."""
    reference = small_cnn(keras.Model)
    return model_class(reference.input, reference.output)


def own_loss_cnn() -> Any:
    return functional(OwnLoss)


def test_a_loss_of_the_models_own_matches_the_full_batch_oracle() -> None:
    # Example i's loss is its share of the recorded losses (their dL/dv held fixed).
    assert_own_model_matches_the_full_batch_oracle(OwnLoss)


def assert_own_model_matches_the_full_batch_oracle(model_class: type) -> None:
    model = compiled(functional(model_class))
    model(X[:2])
    expected = oracle_statistics(model, X, Y, full_batch=True)
    stats = tracked_statistics(model, X, Y)
    assert_matches_oracle(stats, expected)
    assert coupled_in_summary(model) == {"conv0", "bn0", "conv1"}


def test_pairwise_cosine_through_the_batch_statistics() -> None:
    # The coupled layers' Gram matrices from their rows, the others' from their rules.
    model = compiled(applications_block(dropout=0.0))
    names = ["pairwise_cosine", "grad_norm", "cosine"]
    stats = model.gradient_statistics(X, Y, statistics=names)
    expected = oracle_statistics(model, X, Y, full_batch=True)
    assert_matches_oracle(stats, {name: expected[name] for name in names})


@pytest.mark.parametrize("first", [False, True])
def test_input_gradients_are_refused_where_the_batch_statistics_mix_examples(first: bool) -> None:
    # First: no tracked layer before the BatchNormalization is coupled, but every
    # example's input still reaches every loss (as on TensorFlow).
    inputs = keras.Input((8, 8, 2))
    hidden = inputs if first else layers.Conv2D(3, 3, name="conv")(inputs)
    hidden = layers.BatchNormalization(name="bn")(hidden)
    outputs = layers.Dense(3)(layers.GlobalAveragePooling2D()(hidden))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    with pytest.raises(ValueError, match=r"'bn' is a BatchNormalization.*input_grad_norm"):
        model.gradient_statistics(X, Y, statistics=["input_grad_norm"])


# Without dropout: each backend draws its own masks.
# The small CNN's batch normalization is the applications block's case without its
# residual and dropout: `make test-all`.
@pytest.mark.parametrize(
    ("build", "options"),
    [
        pytest.param("small_cnn", {}, marks=pytest.mark.extended),
        ("applications_block", {"dropout": 0.0}),
        ("own_loss_cnn", {}),
    ],
)
def test_tensorflow_gives_the_same_numbers(build: str, options: dict, tmp_path: Path) -> None:
    # The same model, weights and batch through the TensorFlow engine, in its own process.
    model = compiled(globals()[build](**options))
    stats = model.gradient_statistics(X, Y)
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(tmp_path / "inputs.npz", x=X, y=Y, **arrays)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(ROOT / "tests")!r}]
        import numpy as np
        import batch_normalization_cases as case

        inputs = np.load(sys.argv[1])
        model = case.compiled(case.{build}(**{options!r}))
        model.set_weights([inputs[f"w{{i}}"] for i in range(len(model.get_weights()))])
        stats = model.gradient_statistics(inputs["x"], inputs["y"])
        np.savez(sys.argv[2], **stats)
        """
    )
    env = {"KERAS_BACKEND": "tensorflow", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "inputs.npz"), str(tmp_path / "tf.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience.seconds(3),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tensorflow = dict(np.load(tmp_path / "tf.npz"))
    assert_matches_oracle(stats, tensorflow)
