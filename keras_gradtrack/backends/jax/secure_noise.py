"""`secure_noise=True` on JAX: the private step's noise drawn on the host, in float64.

The draw every backend makes (`privacy/secure_noise.py`, Opacus'
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
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from keras_gradtrack.privacy.secure_noise import host_secure_normal


def secure_standard_normal(shape: tuple[int, ...], scale: Any) -> Any:
    """`scale` times secure `N(0, 1)` draws of `shape` (float32), from the host."""
    result = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    draw = functools.partial(host_secure_normal, tuple(shape))
    return io_callback(draw, result, jnp.asarray(scale, jnp.float32), ordered=False)
