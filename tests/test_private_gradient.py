"""The last step of every backend's private step: the clipped sums to the optimizer's
gradient (`engine/private_gradient.noised_gradients`) and what they go over
(`engine/clip_weights.step_divisor`)."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest

from keras_gradtrack.engine.clip_weights import step_divisor
from keras_gradtrack.engine.private_gradient import noised_gradients
from keras_gradtrack.engine.private_settings import PrivacySettings


def variables() -> list[keras.Variable]:
    return [
        keras.Variable(np.zeros((2, 3), np.float32), name="kernel"),
        keras.Variable(np.zeros((3,), np.float32), name="bias"),
    ]


def test_each_gradient_is_its_sum_scaled_plus_its_draw_plus_its_penalty() -> None:
    kernel, bias = variables()
    rng = np.random.default_rng(0)
    sums = {id(kernel): rng.standard_normal((2, 3)), id(bias): rng.standard_normal(3)}
    drawn = []

    def draw(position: int, shape: tuple[int, ...], scale: float) -> np.ndarray:
        drawn.append((position, shape, scale))
        return np.full(shape, 10.0 * (position + 1) * scale, np.float32)

    penalty = rng.standard_normal((2, 3)).astype(np.float32)
    got = noised_gradients([kernel, bias], sums, draw, 0.5, 0.25, [penalty, None])

    assert drawn == [(0, (2, 3), 0.5), (1, (3,), 0.5)]  # one draw per variable, in order
    np.testing.assert_allclose(got[0], sums[id(kernel)] * 0.25 + 5.0 + penalty, rtol=1e-6)
    np.testing.assert_allclose(got[1], sums[id(bias)] * 0.25 + 10.0, rtol=1e-6)
    assert [keras.backend.standardize_dtype(g.dtype) for g in got] == ["float32"] * 2


def test_without_a_draw_nothing_is_added() -> None:
    kernel, bias = variables()
    sums = {id(kernel): np.ones((2, 3), np.float32), id(bias): np.ones(3, np.float32)}
    got = noised_gradients([kernel, bias], sums, None, 1.0, 2.0)
    np.testing.assert_array_equal(got[1], np.full(3, 2.0, np.float32))


def test_a_variable_without_a_clipped_sum_is_refused_by_name() -> None:
    kernel, bias = variables()
    with pytest.raises(ValueError, match=r"every trainable variable to belong.*bias"):
        noised_gradients([kernel, bias], {id(kernel): np.ones((2, 3))}, None, 0.0, 1.0)


def test_the_divisor_is_the_expected_batch_shared_by_the_accumulated_steps() -> None:
    settings = PrivacySettings(
        l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=None, seed=0
    )
    assert step_divisor(settings, 37) == 37  # no expected size: the batch's own
    expected = dataclasses.replace(settings, expected_batch_size=256)
    assert step_divisor(expected, 37) == 256.0
    accumulated = dataclasses.replace(expected, accumulation_steps=4)
    assert step_divisor(accumulated, 37) == 64.0
    assert step_divisor(dataclasses.replace(settings, accumulation_steps=4), 37) == 37
