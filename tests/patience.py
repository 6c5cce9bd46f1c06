"""How long a test waits for another process or thread before it calls it hung,
scaled to this machine as it is now.

The waits are for events (a line, an exit, a set flag), so a long limit costs
nothing unless something hangs. The limits are multiples of a measured baseline,
`import_seconds`: how long this process took from its start to import Keras and
TensorFlow (tests/conftest.py marks when they are in), which grows with a slower
CPU, a busier one or a colder disk alike. A machine ten times slower than the
one the tests were written on measures a baseline ten times longer.

Example:
    child.communicate(timeout=patience.seconds(imports=2))
"""

from __future__ import annotations

import time

import psutil

# What importing Keras and TensorFlow took on a quiet 2-core machine (AVX-512,
# warm disk): the baseline against which `slowdown` is taken.
QUIET_IMPORT_SECONDS = 6.0
# A hang is called after this many times the expected wait, and never sooner
# than a minute: generous, as only a hung process ever waits that long.
MARGIN = 10
FLOOR_SECONDS = 60.0

_import_seconds: float | None = None


def imports_done() -> None:
    """Records that the suite's imports finished (called once, by tests/conftest.py)."""
    global _import_seconds
    if _import_seconds is None:
        _import_seconds = time.time() - psutil.Process().create_time()


def import_seconds() -> float:
    """Seconds this process took to import Keras and TensorFlow."""
    imports_done()
    assert _import_seconds is not None
    return max(_import_seconds, QUIET_IMPORT_SECONDS)


def slowdown() -> float:
    """How many times slower than the quiet machine this one is now (at least 1)."""
    return import_seconds() / QUIET_IMPORT_SECONDS


def seconds(imports: float = 1.0) -> float:
    """The limit for work that takes about `imports` imports of Keras and TensorFlow
    in a fresh process (a child that imports them and trains a step is about 1;
    five such children started together on two cores, about 5 each)."""
    return max(FLOOR_SECONDS, MARGIN * imports * import_seconds())
