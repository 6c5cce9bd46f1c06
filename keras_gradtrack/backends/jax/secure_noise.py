"""`secure_noise=True` on JAX: the private step's noise drawn on the host, in float64.

The same draw as the TensorFlow engine's (`engine/secure_noise.py`, Opacus'
`secure_mode`): the bits from the operating system's cryptographically secure
generator (`os.urandom`), nothing seeded; 53-bit uniforms in (0, 1]; each number the
sum of 4 float64 Box-Muller draws over 2 (Holohan and Braghin 2021), scaled in
float64 and cast to float32 once. JAX computes in float32 unless x64 is enabled, so
the whole draw runs on the host, reached from the compiled step by
`jax.experimental.io_callback` (a side effect: it runs on every step, never cached).

Example:

```python
noise = secure_standard_normal((256, 10), scale)   # float32, in the jitted step
```
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

# Gaussian samples summed per number (Opacus' `2n` with `n = 2`).
SUMMED_SAMPLES = 4
MANTISSA_BITS = 53


def host_secure_normal(shape: tuple[int, ...], scale: Any) -> np.ndarray:
    """`scale` times `N(0, 1)` draws of `shape` from `os.urandom`, float64, cast once."""
    count = math.prod(shape)
    pairs = SUMMED_SAMPLES * count // 2  # one uniform per normal: a radius and an angle
    words = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    mantissa = words >> np.uint64(64 - MANTISSA_BITS)
    uniform = (mantissa.astype(np.float64) + 1.0) * 2.0**-MANTISSA_BITS  # (0, 1]
    radius = np.sqrt(-2.0 * np.log(uniform[0]))
    angle = (2.0 * math.pi) * uniform[1]
    normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
    normal = normal.reshape(SUMMED_SAMPLES, count).sum(axis=0)
    scaled = normal * (float(np.asarray(scale)) / math.sqrt(SUMMED_SAMPLES))
    return scaled.astype(np.float32).reshape(shape)


def secure_standard_normal(shape: tuple[int, ...], scale: Any) -> Any:
    """`scale` times secure `N(0, 1)` draws of `shape` (float32), from the host."""
    result = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    draw = functools.partial(host_secure_normal, tuple(shape))
    return io_callback(draw, result, jnp.asarray(scale, jnp.float32), ordered=False)
