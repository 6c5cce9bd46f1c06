"""The private step's Gaussian noise (`clipping.standard_normal`): its distribution,
checked on a million draws against the standard normal's CDF, moments and tails."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from keras_gradtrack.engine.clipping import standard_normal


def draws(shape: tuple[int, ...], seed: tuple[int, int]) -> np.ndarray:
    return standard_normal(shape, tf.constant(seed, tf.int64)).numpy()


def test_draws_are_standard_normal() -> None:
    z = draws((999, 1001), (7, 0))  # an odd count: the last pair is cut
    assert z.shape == (999, 1001) and z.dtype == np.float32
    z = z.ravel().astype(np.float64)
    n = z.size
    assert np.all(np.isfinite(z))
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1) < 5 / math.sqrt(2 * n)
    # Kurtosis 3 (variance of z^4: 96), and the tails beyond 2 and 3.
    assert abs(np.mean(z**4) - 3) < 5 * math.sqrt(96 / n)
    for t in (2.0, 3.0):
        p = math.erfc(t / math.sqrt(2))
        assert abs(np.mean(np.abs(z) > t) - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Kolmogorov-Smirnov against the normal CDF, on every 5th draw: D < 1.95/sqrt(m)
    # is the 0.1% level.
    sample = np.sort(z[::5])
    m = sample.size
    cdf = 0.5 * (1 + np.vectorize(math.erf)(sample / math.sqrt(2)))
    distance = max(np.max(np.arange(1, m + 1) / m - cdf), np.max(cdf - np.arange(m) / m))
    assert distance < 1.95 / math.sqrt(m), distance


def test_draws_are_a_function_of_the_seed() -> None:
    np.testing.assert_array_equal(draws((300,), (1, 2)), draws((300,), (1, 2)))
    assert not np.allclose(draws((300,), (1, 2)), draws((300,), (1, 3)))
    # The sine half is not the cosine half.
    z = draws((300,), (1, 2))
    assert abs(np.corrcoef(z[:150], z[150:])[0, 1]) < 0.3
