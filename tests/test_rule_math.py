"""The rule math both engines share (`keras_gradtrack.rule_math`), on the TensorFlow backend.

The cost model's decisions for layers whose form is known, and each function against
its textbook definition in numpy: normalizations against the Keras layers' own
output, Gram norms and Embedding lookups against materialized per-example gradients.
(The JAX engine's rules run the same functions in tests/jax_backend.)
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_gradtrack import rule_math

rng = np.random.default_rng(11)
L = keras.layers


def test_the_cost_model_materializes_where_the_zoo_does() -> None:
    # The text model's Dense(64) on 32 tokens and the Transformer's feed-forward:
    # materialized (that replaces the backward pass' weight gradient).
    assert not rule_math.gram_is_cheaper(32, 64, 64, dots=True)
    assert not rule_math.gram_is_cheaper(32, 64, 128, dots=True)
    # Few positions of a wide layer: the Gram form; unknown positions: materialized.
    assert rule_math.gram_is_cheaper(4, 72, 16, dots=True)
    assert not rule_math.gram_is_cheaper(None, 72, 16, dots=True)
    # The dot with a reference costs `P in out` more in the Gram form.
    assert rule_math.gram_is_cheaper(20, 64, 64, dots=False)
    assert not rule_math.gram_is_cheaper(20, 64, 64, dots=True)
    # Past `MATERIALIZE_MAX_VALUES` values (over all groups) only multiply-adds count.
    assert not rule_math.gram_is_cheaper(20, 64, 256, dots=True)
    assert rule_math.gram_is_cheaper(20, 64, 256, dots=True, groups=8)
    assert rule_math.gram_is_cheaper(100, 512, 512, dots=True)


def test_gram_has_fewer_products_compares_multiply_adds() -> None:
    assert rule_math.gram_has_fewer_products(31, 64, 64)
    assert not rule_math.gram_has_fewer_products(32, 64, 64)  # equal: the product
    assert not rule_math.gram_has_fewer_products(None, 64, 64)


def normal(*shape: int, mean: float = 0.0) -> np.ndarray:
    return rng.normal(mean, 2.0, size=shape).astype("float32")


def close(actual: object, expected: object) -> None:
    np.testing.assert_allclose(keras.ops.convert_to_numpy(actual), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "layer, kept",
    [
        (L.LayerNormalization(axis=-1, center=False, scale=False), [2]),
        (L.LayerNormalization(axis=[1, 2], center=False, scale=False), [1, 2]),
        (L.RMSNormalization(axis=-1), [2]),
    ],
    ids=["layer", "layer_two_axes", "rms"],
)
def test_normalized_inputs_are_the_layers_own(layer: object, kept: list[int]) -> None:
    x, d = normal(4, 3, 5, mean=1.0), normal(4, 3, 5)
    n = keras.ops.convert_to_numpy(layer(x))  # no scale or offset (RMS: scale ones)
    normalize = rule_math.rms_normalized if "RMS" in type(layer).__name__ else None
    normalized = (normalize or rule_math.layer_normalized)(layer, x, kept)
    close(normalized, n)
    summed = tuple(a for a in (1, 2) if a not in kept)
    close(rule_math.affine_per_example(d, normalized, kept), np.sum(d * n, axis=summed))
    close(rule_math.affine_per_example(d, None, kept), np.sum(d, axis=summed))


@pytest.mark.parametrize("axis, shape", [(-1, (4, 3, 3, 6)), (1, (4, 6, 5))])
def test_group_moments_give_the_scale_gradient_without_the_normalized_input(
    axis: int, shape: tuple[int, ...]
) -> None:
    layer = L.GroupNormalization(groups=3, axis=axis, center=False, scale=False)
    x, d = normal(*shape, mean=1.0), normal(*shape)
    n = keras.ops.convert_to_numpy(layer(x))
    channel = axis % len(shape)
    grouped = rule_math.in_groups(x, channel, 3)
    mean, inverse = rule_math.group_moments(grouped, channel, rule_math.epsilon_of(layer))
    close((x - keras.ops.convert_to_numpy(mean)) * keras.ops.convert_to_numpy(inverse), n)
    summed = tuple(a for a in range(1, len(shape)) if a != channel)
    expected = np.sum(d * n, axis=summed)
    close(rule_math.scale_from_moments(x, d, mean, inverse, [channel]), expected)


def test_gram_sq_norms_are_the_materialized_norms() -> None:
    a, d = normal(3, 5, 4), normal(3, 5, 6)
    per_example = np.einsum("bti,bto->bio", a, d)
    close(rule_math.dense_kernel_gradients(a, d), per_example)
    close(rule_math.gram_sq_norms(a, d), np.sum(per_example**2, axis=(1, 2)))


def test_token_norms_and_dots_group_repeated_and_negative_ids() -> None:
    vocabulary = 7
    ids = np.array([[0, -1, 6, 2], [2, -5, 3, 3], [1, 1, 1, 1]])
    d, reference = normal(3, 4, 2), normal(vocabulary, 2)
    per_example = np.zeros((3, vocabulary, 2), "float32")
    for i, row in enumerate(ids):
        for t, token in enumerate(row):
            per_example[i, token % vocabulary] += d[i, t]
    wrapped = rule_math.wrapped_ids(keras.ops.convert_to_tensor(ids), vocabulary)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(wrapped), ids % vocabulary)
    close(rule_math.token_gram_sq_norms(wrapped, d), np.sum(per_example**2, axis=(1, 2)))
    close(rule_math.token_segment_sq_norms(wrapped, d), np.sum(per_example**2, axis=(1, 2)))
    close(
        rule_math.token_dots(wrapped, d, reference), np.einsum("bvk,vk->b", per_example, reference)
    )
