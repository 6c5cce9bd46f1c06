"""The private step's default Gaussian noise (`clipping.standard_normal`): its
distribution, checked on a million draws against the standard normal's moments, tails,
CDF (Kolmogorov-Smirnov) and Anderson-Darling statistic; `assert_standard_normal` is
the check the secure draw (`test_privacy_secure_noise.py`) passes too."""

from __future__ import annotations

import math

import numpy as np
import scipy.stats
import tensorflow as tf

from keras_gradtrack.engine.clipping import standard_normal

# Each check below fails a true N(0, 1) sample with probability about 1e-4 or less
# (the secure draws are not seeded: a fresh sample in every run).
Z = 3.9  # standard errors of a moment's estimate
# Anderson-Darling with the parameters known (0, 1), asymptotic 1e-4 critical value
# (Marsaglia and Marsaglia 2004, `ADinf`: 3.857 is its 1%, 8.09 its 1e-4).
ANDERSON_DARLING_CRITICAL = 8.09


def draws(shape: tuple[int, ...], seed: tuple[int, int]) -> np.ndarray:
    return standard_normal(shape, tf.constant(seed, tf.int64)).numpy()


def assert_standard_normal(z: np.ndarray) -> None:
    """`z` (about a million draws) is a N(0, 1) sample: its mean, variance, skewness and
    kurtosis within `Z` standard errors, its frequencies beyond 2, 3 and 4 sigma inside
    their binomial 1e-4 intervals, and its Kolmogorov-Smirnov and Anderson-Darling
    statistics against N(0, 1) below their 1e-4 critical values."""
    z = np.asarray(z, np.float64).ravel()
    n = z.size
    assert np.all(np.isfinite(z))
    # Standard errors of the sample moments of N(0, 1): mean 1/sqrt(n), variance
    # sqrt(2/n), skewness sqrt(6/n), kurtosis sqrt(24/n).
    assert abs(z.mean()) < Z / math.sqrt(n), z.mean()
    assert abs(z.var() - 1) < Z * math.sqrt(2 / n), z.var()
    assert abs(scipy.stats.skew(z)) < Z * math.sqrt(6 / n), scipy.stats.skew(z)
    kurtosis = scipy.stats.kurtosis(z, fisher=False)
    assert abs(kurtosis - 3) < Z * math.sqrt(24 / n), kurtosis
    for t in (2.0, 3.0, 4.0):
        p = math.erfc(t / math.sqrt(2))  # P[|Z| > t]
        low, high = scipy.stats.binom.interval(1 - 1e-4, n, p)
        beyond = int(np.sum(np.abs(z) > t))
        assert low <= beyond <= high, (t, beyond, low, high)
    ks = scipy.stats.kstest(z, "norm")
    assert ks.pvalue > 1e-4, ks
    cdf = np.clip(scipy.stats.norm.cdf(np.sort(z)), 1e-300, 1 - 1e-16)
    i = np.arange(1, n + 1)
    a2 = -n - np.mean((2 * i - 1) * (np.log(cdf) + np.log1p(-cdf[::-1])))
    assert a2 < ANDERSON_DARLING_CRITICAL, a2


def test_draws_are_standard_normal() -> None:
    z = draws((999, 1001), (7, 0))  # an odd count: the last pair is cut
    assert z.shape == (999, 1001) and z.dtype == np.float32
    assert_standard_normal(z)


def test_a_wrong_distribution_fails_the_check() -> None:
    """The check can fail: a Student t(30) (kurtosis 3.23) and N(0, 1.01^2) do not pass."""
    rng = np.random.default_rng(0)
    for wrong in (rng.standard_t(30, 10**6), 1.01 * rng.standard_normal(10**6)):
        try:
            assert_standard_normal(wrong)
        except AssertionError:
            continue
        raise AssertionError("a non-standard-normal sample passed")


def test_draws_are_a_function_of_the_seed() -> None:
    np.testing.assert_array_equal(draws((300,), (1, 2)), draws((300,), (1, 2)))
    assert not np.allclose(draws((300,), (1, 2)), draws((300,), (1, 3)))
    # The sine half is not the cosine half.
    z = draws((300,), (1, 2))
    assert abs(np.corrcoef(z[:150], z[150:])[0, 1]) < 0.3
