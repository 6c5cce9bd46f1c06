"""The private step's noise from a cryptographically secure source (`secure_noise=True`).

The default noise (`clipping.standard_normal`) is a stateless Box-Muller draw on
float32 uniforms (23 random bits each) from Philox, reproducible from Keras' seed: fast, and
exposed to the floating-point attacks on Gaussian samplers (Mironov 2012; Jin et
al., IEEE S&P 2022: `docs/privacy.md`, "The noise"). The secure draw follows Opacus'
`secure_mode` (`opacus/optimizers/optimizer.py`, `_generate_noise`):

* the random bits come from the operating system's cryptographically secure generator
  (`os.urandom`: Linux's `getrandom`, a ChaCha20 generator seeded by the kernel's
  entropy pool), as Opacus' `torchcsprng` random-device generator reads `/dev/urandom`;
  nothing seeds it, so no two runs draw the same noise;
* every uniform has 53 random bits (a float64's mantissa), `u = (k + 1) 2^-53` for a
  53-bit integer `k`, in (0, 1]: the logarithm is finite;
* Box-Muller in float64 gives `2n = 4` standard normal draws per number, and their sum
  over `sqrt(2n) = 2` is the number (the sum of `2n` Gaussian samples is a Gaussian of
  `2n` times the variance). Holohan and Braghin 2021 ("Secure Random Sampling in
  Differential Privacy", ESORICS 2021) show that one Box-Muller draw reveals the
  uniforms it came from, and that summing several raises an attacker's search from
  `2^p` to `2^(p (2n - 1))` candidates (`p = 53`: `2^159` for `n = 2`), which is why
  Opacus sums 4;
* the noise is scaled in float64 and cast to the variable's float32 once.

Inside the compiled step the bits are fetched from the host by `tf.numpy_function`
(`privacy/secure_noise.os_random_words`, one call per variable, `8 x 4` bytes per
weight); the uniforms, the transform and the sum run as whole-tensor float64
operations in the step's graph, on every core: the same construction as the host draw
the JAX and PyTorch engines call (`privacy/secure_noise.host_secure_normal`, numpy, one
core), in about half its time (the MLP's secure step 50-56 ms against 92-94 ms, B=128,
`benchmarks/privacy.py --secure-noise`, paired). XLA cannot compile a host call: a
model compiled with `jit_compile=True` is refused.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from keras_gradtrack.privacy import secure_noise as host
from keras_gradtrack.privacy.secure_noise import MANTISSA_BITS, SUMMED_SAMPLES


def secure_standard_normal(shape: Any, scale: Any = 1.0, dtype: Any = tf.float32) -> tf.Tensor:
    """`scale` times `N(0, 1)` draws of `shape` from the operating system's CSPRNG, in
    float64, cast to `dtype` once (not seeded: see the module's docstring).

    Each number is the sum of 4 float64 Box-Muller draws on 53-bit uniforms, over 2
    (Opacus' `secure_mode`; Holohan and Braghin 2021).

    Args:
        shape: The draws' shape (static).
        scale: Multiplies the draws (in float64, before the cast).
        dtype: The returned tensor's dtype.

    Example:

    ```python
    noise = secure_standard_normal((256, 10), scale=1.1)   # float32, (256, 10)
    ```
    """
    count = math.prod(shape)
    # Box-Muller: one uniform per normal (pairs of a radius and an angle).
    pairs = SUMMED_SAMPLES * count // 2
    words = tf.numpy_function(
        host.os_random_words, [tf.constant(2 * pairs, tf.int64)], tf.uint64, stateful=True
    )
    words = tf.reshape(words, [2, pairs])
    mantissa = tf.bitwise.right_shift(words, tf.constant(64 - MANTISSA_BITS, tf.uint64))
    uniform = (tf.cast(mantissa, tf.float64) + 1.0) * 2.0**-MANTISSA_BITS  # (0, 1]
    radius = tf.sqrt(-2.0 * tf.math.log(uniform[0]))
    angle = (2.0 * math.pi) * uniform[1]
    # cos and sin at once: `exp(i angle)` computes both from one argument reduction
    # (1.6x faster than tf.cos and tf.sin apart, in float64 on this CPU).
    turn = tf.exp(tf.complex(tf.zeros_like(angle), angle))
    normal = tf.concat([radius * tf.math.real(turn), radius * tf.math.imag(turn)], axis=0)
    normal = tf.reduce_sum(tf.reshape(normal, [SUMMED_SAMPLES, count]), axis=0)
    scaled = normal * (tf.cast(scale, tf.float64) / math.sqrt(SUMMED_SAMPLES))
    return tf.reshape(tf.cast(scaled, dtype), shape)
