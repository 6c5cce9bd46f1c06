"""The private step's secure noise on the host (`secure_noise=True`), in numpy, float64.

The same draw as the TensorFlow engine's (`engine/secure_noise.py`, Opacus'
`secure_mode`): the bits from the operating system's cryptographically secure
generator (`os.urandom`), nothing seeded; 53-bit uniforms in (0, 1]; each number the
sum of 4 float64 Box-Muller draws over 2 (Holohan and Braghin 2021), scaled in
float64 and cast to float32 once. The JAX engine reaches it from its compiled step
(`backends/jax/secure_noise.py`); the PyTorch engine calls it eagerly.

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
