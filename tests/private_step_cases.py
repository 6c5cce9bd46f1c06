"""Private training on a probed engine (JAX, PyTorch): the update is the clipped sum of
the per-example gradients (against the backend's own autodiff, one example at a time:
`jax_oracle.py`, `torch_oracle.py`), plus noise of deviation `sigma C`, over
`B_expected`. Each backend's test module imports these cases, so both are held to
the same checks."""

from __future__ import annotations

import importlib
from typing import Any
from unittest import mock

import keras
import numpy as np
import pytest
from backend_models import MODELS
from tolerance import FLOOR, RTOL

import keras_gradtrack as kgt

BACKEND = keras.backend.backend()
oracle_module = importlib.import_module(f"{BACKEND}_oracle")
layer_columns, per_example_gradients = (
    oracle_module.layer_columns,
    oracle_module.per_example_gradients,
)
private_step = importlib.import_module(f"keras_gradtrack.backends.{BACKEND}.private_step")

BATCH = 16
# SGD at this rate: the weights' change is the gradient times it, well above the
# weights' float32 rounding.
RATE = 100.0


def private_model(name: str, seed: int = 7) -> Any:
    keras.utils.set_random_seed(seed)
    builder, _ = MODELS[name]
    model = builder(kgt.GradientTrackingModel)
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def batch(name: str, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    _, shape = MODELS[name]
    rng = np.random.default_rng(3)
    return rng.normal(size=(size, *shape)).astype("float32"), rng.integers(0, 3, size)


def update(model: Any, x: Any, y: Any, **fit: Any) -> list[np.ndarray]:
    """The gradient the optimizer received in one step, per trainable variable."""
    before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(x), shuffle=False, verbose=0, **fit)
    after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    return [(b - a) / RATE for b, a in zip(before, after)]


def per_layer(model: Any, values: list[np.ndarray]) -> list[np.ndarray]:
    return [np.concatenate([values[p].ravel() for p in ps]) for ps in layer_columns(model)]


def clipped_sum(g: list[np.ndarray], bounds: list[float] | float) -> list[np.ndarray]:
    """Per layer, `sum_i min(1, C / ||g_i||) g_i` (one bound), or each layer's rows
    clipped to its own bound (a list)."""
    if isinstance(bounds, list):
        return [
            (rows * np.minimum(1.0, c / np.linalg.norm(rows, axis=1))[:, None]).sum(axis=0)
            for rows, c in zip(g, bounds)
        ]
    norms = np.sqrt(sum((rows**2).sum(axis=1) for rows in g))
    weights = np.minimum(1.0, bounds / norms)
    return [(rows * weights[:, None]).sum(axis=0) for rows in g]


def assert_close(found: list[np.ndarray], expected: list[np.ndarray]) -> None:
    scale = max(np.abs(e).max() for e in expected)
    for f, e in zip(found, expected):
        np.testing.assert_allclose(f, e, rtol=RTOL, atol=FLOOR * scale)


def assert_one_step_without_noise_is_the_clipped_sum(model: Any, x: Any, y: Any) -> None:
    """Makes `model` private at the median per-example norm (about half the examples
    clipped), noise 0, takes one step on (x, y), and checks the update and the logged
    fraction clipped against the per-example oracle."""
    oracle = per_example_gradients(model, x, y)["g"]
    norms = np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle))
    bound = float(np.median(norms))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH for s in clipped_sum(oracle, bound)])
    logs = model.history.history
    assert logs["dp_fraction_clipped"] == [pytest.approx(np.mean(norms > bound))]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer_block"])
def test_without_noise_the_update_is_the_clipped_sum(name: str) -> None:
    model = private_model(name)
    assert_one_step_without_noise_is_the_clipped_sum(model, *batch(name))
    assert model.privacy_history == (kgt.privacy.PrivacyPhase(0.0, None, 1, "unknown"),)


def test_bounds_per_layer_clip_each_layer_alone() -> None:
    model = private_model("mlp")
    x, y = batch("mlp")
    oracle = per_example_gradients(model, x, y)["g"]
    bounds = [float(np.median(np.linalg.norm(rows, axis=1))) for rows in oracle]
    names = model.tracked_layer_names
    model.make_private(l2_norm_clip=dict(zip(names, bounds)), noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH for s in clipped_sum(oracle, bounds)])


def test_groups_clip_their_layers_together() -> None:
    model = private_model("mlp")
    x, y = batch("mlp")
    oracle = per_example_gradients(model, x, y)["g"]
    first, second, head = model.tracked_layer_names
    model.make_private(
        l2_norm_clip={"body": 0.5, "head": 0.2},
        groups={"body": [first, second], "head": [head]},
        noise_multiplier=0.0,
    )
    found = per_layer(model, update(model, x, y))
    body = clipped_sum(oracle[:2], 0.5)
    assert_close(found, [s / BATCH for s in [*body, *clipped_sum(oracle[2:], 0.2)]])


def noise_of(
    sigma: float, bound: float, expected_batch_size: float, seed: int, secure_noise: bool = False
) -> np.ndarray:
    """The noise part of one step's update (the update less the same step without noise)."""
    noises = noise_per_variable(sigma, bound, expected_batch_size, seed, secure_noise)
    return np.concatenate([noise.ravel() for noise in noises])


def noise_per_variable(
    sigma: float, bound: float, expected_batch_size: float, seed: int, secure_noise: bool = False
) -> list[np.ndarray]:
    """`noise_of` per trainable variable."""
    x, y = batch("mlp")
    plain = private_model("mlp", seed)
    plain.make_private(
        l2_norm_clip=bound, noise_multiplier=0.0, expected_batch_size=expected_batch_size
    )
    noisy = private_model("mlp", seed)
    noisy.make_private(
        l2_norm_clip=bound,
        noise_multiplier=sigma,
        expected_batch_size=expected_batch_size,
        secure_noise=secure_noise,
    )
    clean, found = update(plain, x, y), update(noisy, x, y)
    return [f - c for f, c in zip(found, clean)]


def test_each_variable_has_noise_of_its_own() -> None:
    # However a backend draws (one draw per variable, or one for all sliced), no two
    # variables share numbers and the whole is uncorrelated from one variable to the next.
    noises = [n.ravel() for n in noise_per_variable(1.0, 1.0, 1.0, seed=13)]
    assert len(noises) > 2
    for i, first in enumerate(noises):
        for second in noises[i + 1 :]:
            size = min(first.size, second.size)
            assert not np.allclose(first[:size], second[:size])
            assert not np.allclose(first[-size:], second[-size:])
    pairs = np.concatenate(noises)
    correlation = np.corrcoef(pairs[:-1], pairs[1:])[0, 1]
    assert abs(correlation) < 5.0 / np.sqrt(pairs.size)


def test_the_noise_has_deviation_sigma_c_over_the_expected_batch() -> None:
    sigma, bound, expected = 1.3, 0.7, 4.0
    noise = noise_of(sigma, bound, expected, seed=7)
    count = noise.size  # 531 parameters
    want = sigma * bound / expected
    # The sample deviation of n normal draws lies within 5 / sqrt(2n) of the true one
    # (far from a factor: sqrt(2), B / B_expected = 4, or a missing sigma).
    assert abs(np.std(noise) / want - 1.0) < 5.0 / np.sqrt(2 * count)
    assert abs(np.mean(noise)) < 5.0 * want / np.sqrt(count)


@pytest.mark.parametrize("secure_noise", [False, True])
def test_the_noise_has_deviation_sigma_c_with_either_draw(secure_noise: bool) -> None:
    noise = noise_of(0.9, 2.0, 1.0, seed=9, secure_noise=secure_noise)
    want = 0.9 * 2.0
    assert abs(np.std(noise) / want - 1.0) < 5.0 / np.sqrt(2 * noise.size)
    assert abs(np.mean(noise)) < 5.0 * want / np.sqrt(noise.size)


def test_the_secure_noise_is_not_seeded() -> None:
    first = noise_of(1.0, 1.0, 4.0, seed=11, secure_noise=True)
    again = noise_of(1.0, 1.0, 4.0, seed=11, secure_noise=True)
    assert not np.allclose(first, again)


def test_the_noise_is_reproducible_from_the_seed() -> None:
    first = noise_of(1.0, 1.0, 4.0, seed=11)
    again = noise_of(1.0, 1.0, 4.0, seed=11)
    other = noise_of(1.0, 1.0, 4.0, seed=12)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


def test_the_noise_changes_from_step_to_step() -> None:
    model = private_model("mlp")
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4.0)
    x, y = batch("mlp")
    x, y = np.zeros_like(x), np.zeros_like(y)
    # Both steps see the same (clipped, constant) gradient: they differ by the noise.
    first, second = update(model, x, y), update(model, x, y)
    assert not np.allclose(np.concatenate([f.ravel() for f in first]),
                           np.concatenate([s.ravel() for s in second]))  # fmt: skip


def test_a_layer_called_twice_in_a_row_is_clipped_once() -> None:
    # The second call's input depends on the layer's own weights through the first:
    # each call's product holds its recorded input fixed, so that path is counted once.
    keras.utils.set_random_seed(5)
    inputs = keras.Input((12,))
    shared = keras.layers.Dense(12, activation="tanh")
    model = kgt.GradientTrackingModel(inputs, keras.layers.Dense(3)(shared(shared(inputs))))
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch("mlp")
    oracle = per_example_gradients(model, x, y)["g"]
    bound = float(np.median(np.sqrt(sum((rows**2).sum(axis=1) for rows in oracle))))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    assert_close(found, [s / BATCH for s in clipped_sum(oracle, bound)])


def test_weight_penalties_are_added_unclipped() -> None:
    keras.utils.set_random_seed(5)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(inputs)
    outputs = keras.layers.Dense(3, bias_regularizer=keras.regularizers.L1(0.05))(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch("mlp")
    oracle = per_example_gradients(model, x, y)
    g = oracle["g"]
    # G is the compiled loss's mean gradient plus the penalties'.
    penalties = [full - rows.sum(axis=0) / BATCH for full, rows in zip(oracle["G"], g)]
    bound = float(np.median(np.sqrt(sum((rows**2).sum(axis=1) for rows in g))))
    model.make_private(l2_norm_clip=bound, noise_multiplier=0.0)
    found = per_layer(model, update(model, x, y))
    clipped = clipped_sum(g, bound)
    assert_close(found, [s / BATCH + p for s, p in zip(clipped, penalties)])
    assert max(np.abs(p).max() for p in penalties) > 1e-3  # the penalties count


def test_a_convolutions_clipped_sum_comes_from_its_per_example_gradients() -> None:
    # Its norms already need its per-example kernel gradients: the clipped sum is their
    # weighted sum, not the layer's local VJP (a second batch filter gradient).
    model = private_model("cnn")
    x, y = batch("cnn")
    seen: list[str] = []
    local_vjp = private_step.local_vjp

    def spy(layer: Any, *args: Any) -> Any:
        seen.append(type(layer).__name__)
        return local_vjp(layer, *args)

    with mock.patch.object(private_step, "local_vjp", spy):
        assert_one_step_without_noise_is_the_clipped_sum(model, x, y)
    assert "Dense" in seen
    assert "Conv2D" not in seen, seen
