"""The private step's secure noise on the host (`secure_noise=True`), in numpy, float64.

Every backend's secure draw (Opacus' `secure_mode`, `opacus/optimizers/optimizer.py`,
`_generate_noise`): the bits from the operating system's cryptographically secure
generator (`os.urandom`), nothing seeded; 53-bit uniforms in (0, 1]; each number the
sum of 4 float64 Box-Muller draws over 2 (Holohan and Braghin 2021), scaled in
float64 and cast to float32 once. JAX's compiled step reaches it by `io_callback`
(`backends/jax/secure_noise.py`); the PyTorch engine calls it eagerly. TensorFlow's
step fetches only the bits here (`os_random_words`, by `tf.numpy_function`) and runs
the same transform in its graph, on every core (`engine/secure_noise.py`). A large draw
or read here runs in pieces of at least `NUMBERS_PER_PIECE`, one per core, on a pool of
threads (`os.urandom` and numpy's loops release the interpreter's lock), each piece
reading bits of its own: the zoo MLP's six draws in 45-50 ms on 2 cores, against 70-93
ms in one piece (docs/privacy.md, "On every core"). Why these
choices (the attacks on floating-point Gaussian samplers, the cost): docs/privacy.md,
"The noise".

Example:

```python
noise = host_secure_normal((256, 10), 1.1)   # float32 numpy, N(0, 1.1^2)
```
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# Gaussian samples summed per number (Opacus' `2n` with `n = 2`).
SUMMED_SAMPLES = 4
MANTISSA_BITS = 53
# The fewest numbers (or words) a thread of the host draw takes.
NUMBERS_PER_PIECE = 1 << 14


def os_random_words(count: Any) -> np.ndarray:
    """`count` uniformly random 64-bit words from the operating system's CSPRNG, read
    in pieces on every core for a large count (`os.urandom` releases the interpreter's
    lock while the kernel fills its buffer).

    Example:

    ```python
    os_random_words(3)   # e.g. array([..., ..., ...], dtype=uint64), never the same twice
    ```
    """
    words = np.empty(int(count), np.uint64)

    def read(piece: slice) -> None:
        words[piece] = words_of(os.urandom(8 * (piece.stop - piece.start)))

    in_parallel(read, pieces(words.size))
    return words


def host_secure_normal(shape: tuple[int, ...], scale: Any) -> np.ndarray:
    """`scale` times `N(0, 1)` draws of `shape` from `os.urandom`, in float64, cast to
    float32 once: each number the sum of 4 Box-Muller draws on 53-bit uniforms, over 2
    (Holohan and Braghin 2021). A large draw runs in pieces on every core, each piece
    reading bits of its own."""
    count = math.prod(shape)
    factor = float(np.asarray(scale)) / math.sqrt(SUMMED_SAMPLES)
    drawn = np.empty(count, np.float32)

    def draw(piece: slice) -> None:
        numbers = piece.stop - piece.start
        drawn[piece] = standard_sums(words_of(os.urandom(8 * SUMMED_SAMPLES * numbers))) * factor

    in_parallel(draw, pieces(count))
    return drawn.reshape(shape)


def standard_sums(words: np.ndarray) -> np.ndarray:
    """`len(words) / 4` float64 numbers, each the sum of 4 Box-Muller draws (two pairs:
    a radius and an angle each, from one 53-bit uniform each) times 2."""
    count = words.size // SUMMED_SAMPLES
    pairs = SUMMED_SAMPLES * count // 2
    mantissa = words.reshape(2, pairs) >> np.uint64(64 - MANTISSA_BITS)
    uniform = (mantissa.astype(np.float64) + 1.0) * 2.0**-MANTISSA_BITS  # (0, 1]
    radius = np.sqrt(-2.0 * np.log(uniform[0]))
    angle = (2.0 * math.pi) * uniform[1]
    normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
    return normal.reshape(SUMMED_SAMPLES, count).sum(axis=0)


def words_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint64)


def pieces(count: int) -> list[slice]:
    """`[0, count)` in one piece per core, none smaller than `NUMBERS_PER_PIECE` (one
    piece below it: a thread's start costs more than it saves)."""
    parts = max(1, min(os.cpu_count() or 1, count // NUMBERS_PER_PIECE))
    bounds = [count * k // parts for k in range(parts + 1)]
    return [slice(start, end) for start, end in itertools.pairwise(bounds)]


def in_parallel(work: Callable[[slice], None], parts: list[slice]) -> None:
    """`work` on every piece, on this process' threads (inline for one piece)."""
    if len(parts) == 1:
        work(parts[0])
        return
    list(threads(os.getpid()).map(work, parts))  # raises what a piece raised


@functools.cache
def threads(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per process (`pid`): a pool's threads do not survive a fork."""
    del pid
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=os.cpu_count(), thread_name_prefix="secure_noise"
    )
