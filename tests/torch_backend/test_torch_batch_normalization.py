"""BatchNormalization in training on PyTorch, opted in: the cases of
`batch_normalization_cases.py` (which JAX runs too), and a `train_step` of one's own
through `tracked_backward`."""

from __future__ import annotations

import keras
from backend_oracle import assert_trains_as_plain
from batch_normalization_cases import *  # noqa: F403 (the shared cases, collected here)
from batch_normalization_cases import (
    assert_own_model_matches_the_full_batch_oracle,
    compiled,
    functional,
    rng,
)
from test_torch_own_train_step import compute_loss_step_class

import keras_gradtrack as kgt


def test_a_step_of_the_models_own_matches_the_full_batch_oracle() -> None:
    assert_own_model_matches_the_full_batch_oracle(
        compute_loss_step_class(kgt.GradientTrackingModel, True)
    )


def test_a_step_of_the_models_own_trains_as_with_loss_backward() -> None:
    x = rng.normal(size=(12, 8, 8, 2)).astype("float32")
    y = rng.integers(0, 3, 12)
    tracked = compiled(functional(compute_loss_step_class(kgt.GradientTrackingModel, True)))
    plain = compiled(functional(compute_loss_step_class(keras.Model, False)), chunk_size=None)
    assert_trains_as_plain(tracked, plain, x, y, batch_size=6)
