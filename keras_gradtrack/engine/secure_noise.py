"""`secure_noise=True` on TensorFlow: the private step's noise drawn on the host, in float64.

The draw every backend makes (`privacy/secure_noise.py`, Opacus' `secure_mode`):
the bits from the operating system's cryptographically secure generator
(`os.urandom`), nothing seeded; 53-bit uniforms in (0, 1]; each number the sum of 4
float64 Box-Muller draws over 2 (Holohan and Braghin 2021), scaled in float64 and cast
once. The compiled step reaches it by `tf.numpy_function` (stateful: it runs on every
step, never folded into a constant), one call per variable. XLA cannot compile a host
call: a model compiled with `jit_compile=True` is refused (`make_private`).

Example:

```python
noise = secure_standard_normal((256, 10), scale=1.1)   # float32, (256, 10)
```
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from keras_gradtrack.privacy.secure_noise import host_secure_normal


def secure_standard_normal(shape: Any, scale: Any = 1.0, dtype: Any = tf.float32) -> tf.Tensor:
    """`scale` times secure `N(0, 1)` draws of `shape` (static), cast to `dtype` once."""
    dtype = tf.as_dtype(dtype)
    draw = functools.partial(host_secure_normal, tuple(shape), dtype=dtype.as_numpy_dtype)
    noise = tf.numpy_function(draw, [tf.cast(scale, tf.float64)], dtype, stateful=True)
    return tf.ensure_shape(noise, shape)
