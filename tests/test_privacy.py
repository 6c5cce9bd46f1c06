"""Private training (DP-SGD): the clipped sum against the oracle, the noise, the refusals.

With the noise off and SGD at learning rate 1, one step of `fit` moves the weights
by `-sum_i min(1, C / ||g_i||) g_i / B`, `g_i` from `tests/oracle.py` (one tape per
example, float64).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import h5py
import keras
import numpy as np
import oracle
import pytest
import tensorflow as tf
from keras import layers

import keras_gradtrack as kgt

# float32 sums of B per-example terms taken in another order than the oracle's float64.
RTOL = 1e-5


def compiled(model: Any, loss: Any = None, **kwargs: Any) -> Any:
    loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss=loss, **kwargs)
    return model


def expected_update(model: Any, x: Any, y: Any, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """`(sum_i min(1, C/||g_i||) g_i / B` flattened in the oracle's column order, `||g_i||`)."""
    found = oracle.per_example_gradients(model, x, y)
    g = np.concatenate(found["g"], axis=1)
    norms = np.linalg.norm(g, axis=1)
    weights = np.minimum(1.0, clip / norms)
    return (weights[:, None] * g).sum(axis=0) / len(g), norms


def flat_by_column(model: Any, values: list[np.ndarray]) -> np.ndarray:
    """Per-variable arrays (order of `trainable_variables`) flattened in the oracle's order."""
    names, column = oracle.layer_columns(model)
    parts: list[list[np.ndarray]] = [[] for _ in names]
    for variable, value in zip(model.trainable_variables, values):
        parts[column[id(variable)]].append(np.asarray(value, np.float64).ravel())
    return np.concatenate([np.concatenate(p) for p in parts])


def private_update(model: Any, x: Any, y: Any, **kwargs: Any) -> np.ndarray:
    """`-(change of the weights)` after one private step of `fit` (SGD, learning rate 1)."""
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0, **kwargs)
    after = [v.numpy() for v in model.trainable_variables]
    return flat_by_column(model, [b - a for b, a in zip(before, after)])


def assert_clipped_update(model: Any, x: Any, y: Any, clip_quantile: float = 0.5) -> None:
    """With C at a quantile of the norms (some examples clipped, some not), one step moves
    the weights by the oracle's clipped mean."""
    model(x[:1])
    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.quantile(norms, clip_quantile))
    expected, _ = expected_update(model, x, y, clip)
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    update = private_update(model, x, y)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * scale)


def test_dense_update_is_the_clipped_mean() -> None:
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(7, activation="tanh"), layers.Dense(3)]
        )
    )
    assert_clipped_update(model, x, y)


def test_conv2d_update_is_the_clipped_mean() -> None:
    x = np.random.default_rng(1).normal(size=(6, 8, 8, 2)).astype("float32")
    y = np.arange(6) % 3
    model = compiled(
        kgt.GradientTrackingSequential(
            [
                keras.Input((8, 8, 2)),
                layers.Conv2D(4, 3, activation="relu"),
                layers.Conv2D(3, 3, strides=2, padding="same"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(3),
            ]
        )
    )
    assert_clipped_update(model, x, y)


def test_embedding_and_layer_normalization_update_is_the_clipped_mean() -> None:
    x = np.random.default_rng(2).integers(0, 12, size=(8, 5))
    x[:, 0] = 3  # an id that every example uses
    y = np.arange(8) % 2
    model = compiled(
        kgt.GradientTrackingSequential(
            [
                keras.Input((5,), dtype="int32"),
                layers.Embedding(12, 6),
                layers.LayerNormalization(),
                layers.GlobalAveragePooling1D(),
                layers.Dense(2),
            ]
        )
    )
    assert_clipped_update(model, x, y)


def test_multi_head_attention_update_is_the_clipped_mean() -> None:
    inputs = keras.Input((4, 6))
    hidden = layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(hidden))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    x = np.random.default_rng(3).normal(size=(6, 4, 6)).astype("float32")
    assert_clipped_update(model, x, np.arange(6) % 3)


def test_lstm_update_is_the_clipped_mean() -> None:
    model = compiled(
        kgt.GradientTrackingSequential(
            [
                keras.Input((5, 3)),
                layers.LSTM(4, return_sequences=True),
                layers.LSTM(3),
                layers.Dense(2),
            ]
        )
    )
    x = np.random.default_rng(4).normal(size=(6, 5, 3)).astype("float32")
    assert_clipped_update(model, x, np.arange(6) % 2)


def test_keras_hub_encoder_update_is_the_clipped_mean() -> None:
    keras_hub = pytest.importorskip("keras_hub")
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras_hub.layers.TokenAndPositionEmbedding(20, 6, 8)(inputs)
    hidden = keras_hub.layers.TransformerEncoder(16, 2)(hidden)
    outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(hidden))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    x = np.random.default_rng(5).integers(1, 20, size=(6, 6))
    assert_clipped_update(model, x, np.arange(6) % 2)


def test_per_layer_bounds_clip_each_layer() -> None:
    x = np.random.default_rng(6).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(7, activation="tanh"), layers.Dense(3)]
        )
    )
    found = oracle.per_example_gradients(model, x, y)
    bounds = {
        name: float(np.median(np.linalg.norm(g, axis=1)))
        for name, g in zip(found["layers"], found["g"])
    }
    expected = np.concatenate(
        [
            (np.minimum(1.0, bounds[name] / np.linalg.norm(g, axis=1))[:, None] * g).sum(0) / len(g)
            for name, g in zip(found["layers"], found["g"])
        ]
    )
    model.make_private(l2_norm_clip=bounds, noise_multiplier=0.0)
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_one_huge_gradient_moves_the_update_by_at_most_c_over_b() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    x_huge = x.copy()
    x_huge[0] *= 1e4
    clip, batch = 0.5, 8

    def update(x_batch: np.ndarray, y_batch: np.ndarray) -> np.ndarray:
        keras.utils.set_random_seed(0)
        model = compiled(
            kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(4), layers.Dense(3)])
        )
        model.make_private(l2_norm_clip=clip, noise_multiplier=0.0, expected_batch_size=batch)
        return private_update(model, x_batch, y_batch)

    without = update(x[1:], y[1:])
    with_huge = update(x_huge, y)
    assert np.linalg.norm(with_huge - without) <= clip / batch * (1 + 1e-5)


def noisy_minus_clean(sigma: float, clip: float, strategy: Any = None) -> tuple[np.ndarray, int]:
    """The noise part of one private step's update (the same step without noise
    subtracted), on a layer of 2400 weights, and the batch size."""
    x = np.random.default_rng(8).normal(size=(16, 40)).astype("float32")
    y = np.arange(16) % 60

    def update(noise: float) -> np.ndarray:
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = compiled(kgt.GradientTrackingSequential([keras.Input((40,)), layers.Dense(60)]))
            model.make_private(l2_norm_clip=clip, noise_multiplier=noise)
        return private_update(model, x, y)

    return update(sigma) - update(0.0), len(y)


def assert_noise_std(noise: np.ndarray, std: float) -> None:
    # The sample standard deviation of n normal draws has relative error ~ 1/sqrt(2n):
    # 1.4% for 2460 weights; 5 of those.
    relative_error = 1 / np.sqrt(2 * noise.size)
    assert abs(noise.std() / std - 1) < 5 * relative_error, (noise.std(), std)
    assert abs(noise.mean()) < 5 * std / np.sqrt(noise.size)


def test_noise_has_standard_deviation_sigma_c_over_b() -> None:
    noise, batch = noisy_minus_clean(sigma=1.3, clip=0.7)
    assert_noise_std(noise, 1.3 * 0.7 / batch)


def test_noise_is_added_once_under_a_strategy(two_cpu_strategy: Any) -> None:
    """Two replicas each adding noise would give sqrt(2) times the standard deviation."""
    noise, batch = noisy_minus_clean(sigma=1.3, clip=0.7, strategy=two_cpu_strategy)
    assert_noise_std(noise, 1.3 * 0.7 / batch)


def test_clipped_mean_under_a_strategy_is_the_oracle(two_cpu_strategy: Any) -> None:
    x = np.random.default_rng(9).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    with two_cpu_strategy.scope():
        model = compiled(
            kgt.GradientTrackingSequential(
                [keras.Input((5,)), layers.Dense(7, activation="tanh"), layers.Dense(3)]
            )
        )
    assert_clipped_update(model, x, y)


def test_noise_is_reproducible_from_keras_seed() -> None:
    first, _ = noisy_minus_clean(sigma=1.0, clip=1.0)
    second, _ = noisy_minus_clean(sigma=1.0, clip=1.0)
    np.testing.assert_array_equal(first, second)


def test_steps_without_a_logger_are_private_and_logged_in_fit() -> None:
    x = np.random.default_rng(10).normal(size=(32, 5)).astype("float32")
    y = np.arange(32) % 3
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    model.make_private(l2_norm_clip=1e-3, noise_multiplier=0.5)
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kgt.privacy.PrivacyAccountant(delta=1e-5)],
    )
    assert model.private_steps == 8
    np.testing.assert_allclose(history.history["dp_fraction_clipped"], [1.0, 1.0])
    expected = [kgt.privacy.compute_epsilon(0.5, 1 / 4, steps, 1e-5) for steps in (4, 8)]
    np.testing.assert_allclose(history.history["epsilon"], expected)


def test_poisson_batches_train_with_variable_sizes() -> None:
    x = np.random.default_rng(11).normal(size=(200, 5)).astype("float32")
    y = np.arange(200) % 3
    dataset = kgt.privacy.poisson_batches(x, y, sampling_rate=0.1, steps=5, seed=0)
    sizes = [len(batch_y) for _, batch_y in dataset]
    assert len(sizes) == 5 and len(set(sizes)) > 1
    assert sizes != [len(batch_y) for _, batch_y in dataset]  # each pass draws anew
    indices = list(kgt.privacy.poisson_batch_indices(200, 0.1, steps=200, seed=1))
    assert abs(np.mean([len(i) for i in indices]) - 20) < 1.0
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=20)
    model.fit(dataset, epochs=2, verbose=0, shuffle=False)
    assert model.private_steps == 10


def test_poisson_batches_draw_the_same_rows_as_a_py_dataset() -> None:
    # JAX and PyTorch get the keras.utils.PyDataset of the same stream: the same batches.
    from keras_gradtrack.privacy.sampling import PoissonBatches, PoissonStream

    x = np.arange(60, dtype="float32").reshape(30, 2)
    y = np.arange(30)
    dataset = kgt.privacy.poisson_batches(x, y, 0.3, steps=4, seed=5, accumulation_steps=2)
    py_dataset = PoissonBatches(PoissonStream((x, y), 30, 0.3, 4, 5, 2))
    assert len(py_dataset) == 8
    for _ in range(2):  # two epochs, each drawn anew
        found = [py_dataset[i][1] for i in range(len(py_dataset))]
        py_dataset.on_epoch_end()
        expected = [np.asarray(batch_y) for _, batch_y in dataset]
        assert len(found) == len(expected) == 8
        for got, want in zip(found, expected):
            np.testing.assert_array_equal(got, want)


# -- the accountant ------------------------------------------------------------


def test_epsilon_is_dp_accounting_own() -> None:
    dpa = pytest.importorskip("dp_accounting")
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 1000)
    rdp = dpa.rdp.RdpAccountant()
    rdp.compose(event)
    pld = dpa.pld.PLDAccountant()
    pld.compose(event)
    assert kgt.privacy.compute_epsilon(1.1, 0.01, 1000, 1e-5) == rdp.get_epsilon(1e-5)
    assert kgt.privacy.compute_epsilon(1.1, 0.01, 1000, 1e-5, "pld") == pld.get_epsilon(1e-5)


@pytest.mark.parametrize(("sigma", "epochs", "published"), [(1.12, 60, 2.92), (1.2, 10, 1.20)])
def test_epsilon_of_tensorflow_privacy_mnist_tutorial(
    sigma: float, epochs: int, published: float
) -> None:
    """TensorFlow Privacy's `tutorials/README.md` ("Select Parameters": MNIST, 60000
    examples, 256 per batch, delta 1e-5) publishes epsilon 2.92 (sigma 1.12, 60 epochs)
    and 1.20 (sigma 1.2, 10 epochs). Its 2019 RDP accountant converted RDP to
    (epsilon, delta) with the classic bound `min_a rdp(a) + log(1/delta) / (a - 1)`
    over its orders; dp-accounting's RDP curve with that conversion gives the published
    values, and its own conversion (tighter) a smaller epsilon."""
    dpa = pytest.importorskip("dp_accounting")
    q, steps = 256 / 60000, epochs * 60000 // 256
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    accountant = dpa.rdp.RdpAccountant(orders)
    accountant.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    )
    classic = min(r + np.log(1e5) / (a - 1) for r, a in zip(accountant._rdp, orders))
    assert round(classic, 2) == published
    assert kgt.privacy.compute_epsilon(sigma, q, steps, 1e-5) < published


def test_noise_multiplier_for_a_target_epsilon() -> None:
    q, steps = 256 / 60000, 60 * 60000 // 256
    sigma = kgt.privacy.compute_noise_multiplier(3.0, q, steps, 1e-5)
    assert kgt.privacy.compute_epsilon(sigma, q, steps, 1e-5) <= 3.0
    assert kgt.privacy.compute_epsilon(sigma * 0.99, q, steps, 1e-5) > 3.0


# -- refusals ------------------------------------------------------------------


def test_invalid_arguments_are_refused() -> None:
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    with pytest.raises(ValueError, match="Expected l2_norm_clip to be a positive"):
        model.make_private(l2_norm_clip=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="Expected noise_multiplier"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="Expected expected_batch_size"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0)
    with pytest.raises(ValueError, match="one bound per tracked layer"):
        model.make_private(l2_norm_clip={"nope": 1.0}, noise_multiplier=1.0)
    uncompiled = kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)])
    with pytest.raises(ValueError, match="is not compiled"):
        uncompiled.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="sampling_rate"):
        kgt.privacy.compute_epsilon(1.0, 0.0, 10, 1e-5)


def test_batch_normalization_is_refused() -> None:
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(4), layers.BatchNormalization(), layers.Dense(3)]
        )
    )
    with pytest.raises(ValueError, match="convert_to_group_normalization"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)


class AddsLoss(layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * keras.ops.sum(x))
        return x


class MixesExamples(layers.Layer):
    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


@pytest.mark.parametrize(("layer", "message"), [(AddsLoss(), "add_loss"), (MixesExamples(), "mix")])
def test_unprivate_models_are_refused_before_any_weight_changes(layer: Any, message: str) -> None:
    model = compiled(
        kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(4), layer, layers.Dense(3)])
    )
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    before = [v.numpy() for v in model.variables]
    x = np.random.default_rng(12).normal(size=(8, 5)).astype("float32")
    with pytest.raises(ValueError, match=message):
        model.fit(x, np.arange(8) % 3, batch_size=8, verbose=0)
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_loss_that_reduces_the_batch_itself_is_refused() -> None:
    def batch_mean(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred))

    model = compiled(
        kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]), loss=batch_mean
    )
    model.check_example_independence = False  # the loss itself is what is refused here
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(ValueError, match="whole batch"):
        model.fit(np.ones((8, 5), "float32"), np.zeros((8, 3)), batch_size=8, verbose=0)
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_penalties_are_added_unclipped() -> None:
    x = np.random.default_rng(13).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5))]
        )
    )
    model(x[:1])
    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.median(norms))
    expected, _ = expected_update(model, x, y, clip)
    kernel = model.layers[0].kernel.numpy().ravel()
    expected[: kernel.size] += 2 * 0.5 * kernel  # d/dw of 0.5 ||w||^2 ... L2(0.5) = 0.5 sum w^2
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_recurrent_direct_form_update_is_the_clipped_mean() -> None:
    """Short sequences, wide kernels: the recurrent rule's direct form, whose clipped sum
    comes from its per-example gradients of the reweighted output gradients."""
    model = compiled(
        kgt.GradientTrackingSequential([keras.Input((2, 24)), layers.GRU(24), layers.Dense(2)])
    )
    x = np.random.default_rng(14).normal(size=(6, 2, 24)).astype("float32")
    assert_clipped_update(model, x, np.arange(6) % 2)
    assert model.gradient_tracking.forms[model.layers[0].name] == "direct"


def test_chunked_form_update_is_the_clipped_mean() -> None:
    """More examples than a chunk: the convolution's per-example gradients are never held
    whole, and its clipped sum is the local vector-Jacobian product."""
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((8, 8, 16)), layers.Conv2D(16, 3), layers.Flatten(), layers.Dense(2)]
        )
    )
    x = np.random.default_rng(15).normal(size=(130, 8, 8, 16)).astype("float32")
    assert_clipped_update(model, x, np.arange(130) % 2)
    assert model.gradient_tracking.forms[model.layers[0].name] == "materialized"


class OwnStep(kgt.GradientTrackingModel):
    """A train_step of the user's own: `tracked_gradient` in place of `tape.gradient`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = self.tracked_gradient(tape, loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"loss": loss}


def test_custom_train_step_is_private_through_tracked_gradient() -> None:
    inputs = keras.Input((5,))
    outputs = layers.Dense(3)(layers.Dense(4, activation="relu")(inputs))
    model = compiled(OwnStep(inputs, outputs))
    x = np.random.default_rng(16).normal(size=(8, 5)).astype("float32")
    assert_clipped_update(model, x, np.arange(8) % 3)


def test_mixed_precision_clips_the_unscaled_gradients_in_float32() -> None:
    """Under mixed_float16 (loss scaling), the update is the float32 oracle's clipped
    mean to float16's precision (11 significant bits)."""
    x = np.random.default_rng(17).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(
            kgt.GradientTrackingSequential(
                [
                    keras.Input((5,)),
                    layers.Dense(6, activation="tanh"),
                    layers.Dense(3, dtype="float32"),
                ]
            )
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model(x[:1])
    _, norms = expected_update(model, x, y, 1.0)
    clip = float(np.median(norms))
    expected, _ = expected_update(model, x, y, clip)
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    update = private_update(model, x, y)
    np.testing.assert_allclose(update, expected, rtol=5e-3, atol=5e-3 * np.abs(expected).max())


def test_the_log_holds_the_pre_clip_norms_and_the_fraction_clipped(tmp_path: Any) -> None:
    x = np.random.default_rng(18).normal(size=(16, 5)).astype("float32")
    y = np.arange(16) % 3
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    model(x[:1])
    _, norms = expected_update(model, x[:8], y[:8], 1.0)
    clip = float(np.median(norms))
    model.make_private(l2_norm_clip=clip, noise_multiplier=0.0)
    path = tmp_path / "run.h5"
    logger = kgt.HDF5GradientLogger(path, statistics=["grad_norm"])
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5, logger=logger)
    history = model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[accountant, logger]
    )
    with kgt.GradientLog(path) as log:
        logged = log.per_example("dp_grad_norm")
        np.testing.assert_allclose(logged[:8], norms, rtol=1e-5)
        np.testing.assert_array_equal(logged, log.per_example("grad_norm"))
        fractions = log.per_step("dp_fraction_clipped")
        assert fractions[0] == np.mean(norms > clip)
    # fit's logs hold each step's fraction (an epoch's entry: its last step's).
    np.testing.assert_allclose(history.history["dp_fraction_clipped"], fractions[-1:])
    with h5py.File(path, "r") as file:
        assert file.attrs["dp_l2_norm_clip"] == pytest.approx(clip)
        assert file.attrs["dp_noise_multiplier"] == 0.0
        assert file.attrs["dp_epsilon"] == np.inf  # no noise: no privacy
        assert file.attrs["dp_steps"] == 2 and file.attrs["dp_sampling_rate"] == 0.5
    with kgt.GradientLog(path) as log:
        text = log.summary()
    assert "DP-SGD" in text and "epsilon inf at delta 1e-05 after 2 steps" in text
    assert "dp_grad_norm" in text and "dp_fraction_clipped" in text


def test_epsilon_reaches_the_log_attributes_with_noise(tmp_path: Any) -> None:
    x = np.random.default_rng(19).normal(size=(16, 5)).astype("float32")
    model = compiled(kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]))
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1)
    logger = kgt.HDF5GradientLogger(tmp_path / "run.h5", statistics=["loss"])
    accountant = kgt.privacy.PrivacyAccountant(delta=1e-5, sampling_rate=0.25, logger=logger)
    model.fit(x, np.arange(16) % 3, batch_size=4, verbose=0, callbacks=[logger, accountant])
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert file.attrs["dp_epsilon"] == kgt.privacy.compute_epsilon(1.1, 0.25, 4, 1e-5)


def test_steps_per_execution_is_refused() -> None:
    model = compiled(
        kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]), steps_per_execution=2
    )
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)


def test_an_xla_compiled_step_is_the_clipped_mean() -> None:
    x = np.random.default_rng(20).normal(size=(8, 5)).astype("float32")
    model = compiled(
        kgt.GradientTrackingSequential(
            [keras.Input((5,)), layers.Dense(7, activation="tanh"), layers.Dense(3)]
        ),
        jit_compile=True,
    )
    assert_clipped_update(model, x, np.arange(8) % 3)


def test_an_eager_step_is_refused_before_any_weight_changes() -> None:
    model = compiled(
        kgt.GradientTrackingSequential([keras.Input((5,)), layers.Dense(3)]), run_eagerly=True
    )
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(ValueError, match="run_eagerly=False"):
        model.fit(np.ones((4, 5), "float32"), np.zeros(4), batch_size=4, verbose=0)
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_missing_dp_accounting_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import fails
    with pytest.raises(ImportError, match=r"keras-gradtrack\[privacy\]"):
        kgt.privacy.compute_epsilon(1.0, 0.01, 10, 1e-5)


def test_a_layer_called_twice_in_a_row_is_the_clipped_mean() -> None:
    """The second call's input depends on the layer's own weights through the first: the
    local products stop at each call's inputs, whose gradient the backward pass holds."""
    shared = layers.Dense(5, activation="tanh")
    inputs = keras.Input((5,))
    outputs = layers.Dense(3)(shared(shared(inputs)))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    x = np.random.default_rng(21).normal(size=(8, 5)).astype("float32")
    assert_clipped_update(model, x, np.arange(8) % 3)


class Gate(layers.Layer):
    """A layer without a rule (the exact fallback): `x * sigmoid(w)`."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[-1:], initializer="random_normal")

    def call(self, x):
        return x * keras.ops.sigmoid(self.w)


def test_a_layer_without_a_rule_called_twice_in_a_row_is_the_clipped_mean() -> None:
    gate = Gate()
    inputs = keras.Input((5,))
    hidden = layers.Dense(5, activation="tanh")(inputs)
    outputs = layers.Dense(3)(gate(keras.ops.tanh(gate(hidden))))
    model = compiled(kgt.GradientTrackingModel(inputs, outputs))
    x = np.random.default_rng(22).normal(size=(8, 5)).astype("float32")
    assert_clipped_update(model, x, np.arange(8) % 3)
    assert model.gradient_tracking.forms[gate.name] == "jacobian"
