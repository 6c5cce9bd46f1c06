"""Private training of a model with its own `train_step` or `compute_loss` on JAX, as on
TensorFlow (tests/test_privacy.py, `test_custom_train_step_is_private_through_tracked_gradient`):
the gradients `tracked_value_and_grad` returns (or `super().train_step` applies) are
the private ones, the clipped sum of the per-example oracle without noise."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
from backend_models import MODELS
from jax_oracle import per_example_gradients
from test_jax_own_train_step import keras_step_class
from test_jax_private import (
    BATCH,
    RATE,
    assert_close,
    assert_one_step_without_noise_is_the_clipped_sum,
    batch,
    clipped_sum,
    per_layer,
    update,
)

import keras_gradtrack as kgt
from keras_gradtrack.privacy.adaptive_clip import next_bound


class SuperStep(kgt.GradientTrackingModel):
    """A train_step of one's own that calls Keras' through `super().train_step`."""

    def train_step(self, state: Any, data: Any) -> Any:
        logs, state = super().train_step(state, data)
        return {**logs, "own": 1.0}, state


class DoubledLoss(kgt.GradientTrackingModel):
    """A compute_loss of one's own: twice Keras' (penalties included), so each example's
    share of the loss, and the penalties' weight, is 2."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return 2.0 * super().compute_loss(*args, **kwargs)


def compiled(model: Any) -> Any:
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def built(model_class: type) -> Any:
    keras.utils.set_random_seed(7)
    return compiled(MODELS["mlp"][0](model_class))


@pytest.mark.parametrize(
    "model_class",
    [keras_step_class(kgt.GradientTrackingModel, tracked=True), SuperStep],
    ids=["tracked_value_and_grad", "super_train_step"],
)
def test_an_own_train_step_receives_the_clipped_sum(model_class: type) -> None:
    model = built(model_class)
    assert_one_step_without_noise_is_the_clipped_sum(model, *batch("mlp"))
    assert model.private_steps == 1


def test_an_own_train_step_with_noise_is_noised() -> None:
    x, y = batch("mlp")
    updates = []
    for sigma in (0.0, 1.3):
        model = built(keras_step_class(kgt.GradientTrackingModel, tracked=True))
        model.make_private(l2_norm_clip=0.7, noise_multiplier=sigma, expected_batch_size=4.0)
        updates.append(np.concatenate([u.ravel() for u in update(model, x, y)]))
    noise = updates[1] - updates[0]
    want = 1.3 * 0.7 / 4.0
    assert abs(np.std(noise) / want - 1.0) < 5.0 / np.sqrt(2 * noise.size)


def test_an_own_compute_loss_clips_its_examples_shares_and_weighs_its_penalties() -> None:
    """`l_i` is example i's share of the model's own loss (twice the compiled loss's);
    the penalties enter unclipped with the weight the loss gives them (2)."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(inputs)
    outputs = keras.layers.Dense(3, bias_regularizer=keras.regularizers.L1(0.05))(hidden)
    model = compiled(DoubledLoss(inputs, outputs))
    x, y = batch("mlp")
    plain = per_example_gradients(model, x, y)
    g = [2.0 * rows for rows in plain["g"]]
    penalties = [
        2.0 * (full - rows.sum(axis=0) / BATCH) for full, rows in zip(plain["G"], plain["g"])
    ]
    bound = float(np.median(np.sqrt(sum((rows**2).sum(axis=1) for rows in g))))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH + p for s, p in zip(clipped_sum(g, bound), penalties)])
    assert max(np.abs(p).max() for p in penalties) > 1e-3  # the penalties count


def test_an_own_step_that_leaves_the_penalties_out_adds_none() -> None:
    """A loss of one's own without `model.losses` (here: the compiled loss on
    `stateless_call`'s outputs) holds no penalty: none is added to the update."""

    class WithoutPenalties(kgt.GradientTrackingModel):
        def train_step(self, state: Any, data: Any) -> Any:
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

            def loss(trainable: Any) -> Any:
                y_pred, _ = self.stateless_call(trainable, non_trainable, x, training=True)
                return loss_fn(y, y_pred)

            value, grads = self.tracked_value_and_grad(loss)(trainable)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            state = (trainable, non_trainable, optimizer_variables, metrics_variables)
            return {"loss": value}, state

    keras.utils.set_random_seed(5)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(inputs)
    model = compiled(WithoutPenalties(inputs, keras.layers.Dense(3)(hidden)))
    x, y = batch("mlp")
    g = per_example_gradients(model, x, y)["g"]
    bound = float(np.median(np.sqrt(sum((rows**2).sum(axis=1) for rows in g))))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH for s in clipped_sum(g, bound)])


def test_an_own_train_step_moves_the_adaptive_bound() -> None:
    """The bound's variable is read and updated through the model's own step too."""
    model = built(keras_step_class(kgt.GradientTrackingModel, tracked=True))
    x, y = batch("mlp")
    oracle = per_example_gradients(model, x, y)["g"]
    norms = np.sort(np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle)))
    bound = float(norms[7] + norms[8]) / 2  # between two norms: no tie with a norm
    clip = kgt.privacy.AdaptiveClip(target_quantile=0.3, learning_rate=0.2)
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0, adaptive_clip=clip)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH for s in clipped_sum(oracle, bound)])
    assert model.history.history["dp_l2_norm_clip"] == [pytest.approx(bound, rel=1e-6)]
    expected = next_bound(bound, 8, BATCH, 0.0, BATCH, clip)
    assert float(model.__dict__["_adaptive_clip_bound"].numpy()) == pytest.approx(expected)
