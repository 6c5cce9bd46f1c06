"""A step's reported values left on the device until someone reads them.

A compiled step's statistics are computed on the device; copying them to the host
after every step makes the host wait for that step before it can start the next one.
`DeviceRows` holds them where the step left them: reading a value copies the step's
values once (all of them, in one transfer), and `deferred(name)` gives a stand-in that
copies only when converted with `np.asarray`, for a subscriber that keeps rows to
write later (`HDF5GradientLogger`, which converts them with their block).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np


class DeviceRows(Mapping[str, np.ndarray]):
    """A step's values: `host` ones as given, the others from `fetch()` on first read.

    Args:
        fetch: Copies the device values to the host: name -> numpy array, for
            every name of `names`. Called at most once, on any thread.
        names: The names `fetch` returns.
        host: Values already on the host (the batch size, the example ids).

    Example:

    ```python
    rows = DeviceRows(lambda: {"loss": np.asarray(loss)}, ["loss"], {"batch_size": b})
    rows["batch_size"]            # no copy
    later = rows.deferred("loss") # no copy
    np.asarray(later)             # the copy, here
    ```
    """

    def __init__(
        self,
        fetch: Callable[[], Mapping[str, np.ndarray]],
        names: Sequence[str],
        host: Mapping[str, np.ndarray],
    ):
        self._fetch: Callable[[], Mapping[str, np.ndarray]] | None = fetch
        self._host = dict(host)
        self._names = tuple(dict.fromkeys([*names, *self._host]))
        self._fetched: Mapping[str, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def fetched(self) -> bool:
        """Whether the device values have been copied to the host."""
        return self._fetch is None

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._host:
            return self._host[name]
        if name not in self._names:
            raise KeyError(name)
        with self._lock:  # a logger's thread and the training thread may both read
            if self._fetch is not None:
                self._fetched, self._fetch = self._fetch(), None
        return self._fetched[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def deferred(self, name: str) -> Any:
        """`self[name]`, or a stand-in copied from the device when `np.asarray` converts it."""
        if name in self._host or self.fetched:
            return self[name]
        if name not in self._names:
            raise KeyError(name)
        return Deferred(self, name)


class Deferred:
    """One value of a `DeviceRows`, read (and the step's values copied) by `np.asarray`."""

    def __init__(self, rows: DeviceRows, name: str):
        self.rows = rows
        self.name = name

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.array(self.rows[self.name], dtype=dtype, copy=copy)


def deferred(values: Mapping[str, Any], name: str) -> Any:
    """`values[name]`, left on the device when `values` are `DeviceRows`."""
    return values.deferred(name) if isinstance(values, DeviceRows) else values[name]


class ScaledRows:
    """`rows * scale`, computed when `np.asarray` converts it: of `deferred` values, with
    the block that writes it (the step's values stay on the device until then).

    Example:

    ```python
    np.asarray(ScaledRows(np.ones((2, 3)), 0.5))    # 0.5 everywhere
    ```
    """

    def __init__(self, rows: Any, scale: Any):
        self.rows = rows
        self.scale = scale

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        product = np.asarray(self.rows) * np.asarray(self.scale)
        return product if dtype is None else product.astype(dtype)
