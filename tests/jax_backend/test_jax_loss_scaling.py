"""Loss scaling on JAX: the cases of `loss_scaling_cases.py` (which PyTorch runs too), and
a `train_step` of one's own with a loss scale."""

from __future__ import annotations

import keras
from backend_oracle import tracked_statistics
from jax_oracle import assert_matches_oracle, input_grad_norms, oracle_statistics
from loss_scaling_cases import *  # noqa: F403 (the shared cases, collected here)
from loss_scaling_cases import BATCH, OPTIMIZERS, X, Y, compiled_with
from test_jax_own_train_step import keras_step_class

import keras_gradtrack as kgt


def test_an_own_train_step_with_a_loss_scale_optimizer_and_input_gradients() -> None:
    """A `train_step` of one's own: `tracked_value_and_grad` finds the scale where its
    function calls `scale_loss` (Keras' `compute_loss_and_updates`)."""
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model_class = keras_step_class(kgt.GradientTrackingModel, tracked=True)
    model = compiled_with(
        model_class(inputs, keras.layers.Dense(3)(hidden)), OPTIMIZERS["loss_scale_optimizer"]()
    )
    x, y = X[:BATCH], Y[:BATCH]
    model(x[:1])
    expected = oracle_statistics(model, x, y)
    expected["input_grad_norm"] = input_grad_norms(model, x, y)
    names = ["loss", "grad_norm", "cosine", "batch_grad_norm", "input_grad_norm"]
    assert_matches_oracle(tracked_statistics(model, x, y, names=names), expected)
