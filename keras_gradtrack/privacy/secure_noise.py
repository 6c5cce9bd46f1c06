"""The private step's secure noise on the host (`secure_noise=True`), in numpy, float64.

Every backend's secure draw (Opacus' `secure_mode`, `opacus/optimizers/optimizer.py`,
`_generate_noise`): the bits from the operating system's cryptographically secure
generator (`os.urandom`), nothing seeded; 53-bit uniforms in (0, 1]; each number the
sum of 4 float64 Box-Muller draws over 2 (Holohan and Braghin 2021), scaled in
float64 and cast to float32 once. JAX's compiled step reaches it by `io_callback`
(`backends/jax/secure_noise.py`); the PyTorch engine calls it eagerly. TensorFlow's
step fetches only the bits here (`os_random_words`, by `tf.numpy_function`) and runs
the same transform in its graph, on every core (`engine/secure_noise.py`). Why these
choices (the attacks on floating-point Gaussian samplers, the cost): docs/privacy.md,
"The noise".

Example:

```python
noise = host_secure_normal((256, 10), 1.1)   # float32 numpy, N(0, 1.1^2)
```
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

# Gaussian samples summed per number (Opacus' `2n` with `n = 2`).
SUMMED_SAMPLES = 4
MANTISSA_BITS = 53


def os_random_words(count: Any) -> np.ndarray:
    """`count` uniformly random 64-bit words from the operating system's CSPRNG.

    Example:

    ```python
    os_random_words(3)   # e.g. array([..., ..., ...], dtype=uint64), never the same twice
    ```
    """
    return np.frombuffer(os.urandom(8 * int(count)), dtype=np.uint64)


def host_secure_normal(shape: tuple[int, ...], scale: Any) -> np.ndarray:
    """`scale` times `N(0, 1)` draws of `shape` from `os.urandom`, in float64, cast to
    float32 once: each number the sum of 4 Box-Muller draws on 53-bit uniforms, over 2
    (Holohan and Braghin 2021)."""
    count = math.prod(shape)
    pairs = SUMMED_SAMPLES * count // 2  # one uniform per normal: a radius and an angle
    words = os_random_words(2 * pairs).reshape(2, pairs)
    mantissa = words >> np.uint64(64 - MANTISSA_BITS)
    uniform = (mantissa.astype(np.float64) + 1.0) * 2.0**-MANTISSA_BITS  # (0, 1]
    radius = np.sqrt(-2.0 * np.log(uniform[0]))
    angle = (2.0 * math.pi) * uniform[1]
    normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
    normal = normal.reshape(SUMMED_SAMPLES, count).sum(axis=0)
    scaled = normal * (float(np.asarray(scale)) / math.sqrt(SUMMED_SAMPLES))
    return scaled.astype(np.float32).reshape(shape)
