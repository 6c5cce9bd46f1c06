"""`LogReader`: reads a gradient log, also while it is being written."""

import os
from typing import TYPE_CHECKING, Any, TypeVar

import h5py
import numpy as np

from keras_gradtrack.io import schema
from keras_gradtrack.io.hdf5_tables import rows_in_all
from keras_gradtrack.io.read_access import damage_reported, open_for_reading

if TYPE_CHECKING:
    import pandas


_Self = TypeVar("_Self", bound="LogReader")


class LogReader:
    """Read access to a keras_gradtrack gradient log (HDF5), with numpy and pandas.

    The file is opened read-only in SWMR mode when possible, so a log can be read
    while `HDF5GradientLogger` is still writing it; `refresh()` picks up the rows
    written since. Every read of a table returns the rows present in all of its
    datasets, so columns read together always have equal lengths.

    `keras_gradtrack.GradientLog` adds the analyses (summaries, influence
    rankings, export) to this reader.

    Args:
        path: path of the log file.

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: if the file is not a keras_gradtrack log, or was written with an
            unsupported schema version.
        OSError: if the file is damaged (cut short, or overwritten in part).

    Example:

    ```python
    with LogReader("run.h5") as log:
        cosine = log.per_example("cosine")  # (N,): one value per example seen
        per_layer = log.per_example("layer_grad_norm")  # (N, L), columns log.layers
        frame = log.to_pandas("per_step")  # columns step, epoch, batch_size, ...
    ```
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"No keras_gradtrack log at '{self.path}': no such file.")
        if os.path.isdir(self.path):
            raise IsADirectoryError(
                f"Expected the path of a log file. Received a directory: '{self.path}'"
            )
        if not h5py.is_hdf5(self.path):
            raise ValueError(f"'{self.path}' is not a keras_gradtrack log: not an HDF5 file.")
        self._file: h5py.File | None = None
        self._open()

    @property
    def layout(self) -> schema.Layout:
        """What the log holds: layer names and the value columns of each table."""
        return self._layout

    @property
    def layers(self) -> list[str]:
        """The L layer names: the column order of per-layer statistics."""
        return list(self._layout.layer_names)

    @property
    def attrs(self) -> dict[str, Any]:
        """The root attributes: `schema_version`, `library_version`, `created`, ..."""
        file = self._require_open()
        with damage_reported(self.path):
            return {name: _to_python(value) for name, value in file.attrs.items()}

    @property
    def per_example_names(self) -> list[str]:
        """Names of the per-example statistics, in the order they were declared."""
        return list(self._layout.per_example)

    @property
    def per_step_names(self) -> list[str]:
        """Names of the per-step value columns (statistics, `learning_rate`), in file order."""
        return list(self._layout.per_step)

    @property
    def num_examples(self) -> int:
        """Number of complete per-example rows."""
        return self._length(schema.PER_EXAMPLE_GROUP)

    @property
    def num_steps(self) -> int:
        """Number of complete per-step rows."""
        return self._length(schema.PER_STEP_GROUP)

    def per_example(self, name: str) -> np.ndarray:
        """One per-example column: a statistic, `"step"`, `"epoch"` or `"example_id"`.

        Args:
            name: column name.

        Returns:
            Array of shape (N,) or, for a per-layer statistic, (N, L).

        Raises:
            KeyError: for an unknown name; the message lists the available ones.
        """
        return self.read(schema.PER_EXAMPLE_GROUP, name)

    def per_step(self, name: str) -> np.ndarray:
        """One per-step column: a statistic, `"step"`, `"epoch"`, `"batch_size"`, ...

        As `per_example`, one row per step: an array of shape (S,) or, for a per-layer
        statistic, (S, L); a KeyError for an unknown name lists the available ones.
        """
        return self.read(schema.PER_STEP_GROUP, name)

    def read(self, table: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """One column of `table`: its complete rows (those from `start` to `stop`).

        Args:
            table: `"per_example"` or `"per_step"`.
            name: column name (see `layout.columns(table)`).
            start: the first row to read.
            stop: the row to stop before (default: the last complete row); rows
                beyond the complete ones are not read.

        Returns:
            Array of shape (rows,) or, for a per-layer statistic, (rows, L).

        Raises:
            KeyError: for an unknown name; the message lists the available ones.
            OSError: if the file turns out to be damaged.

        Example:

        ```python
        log.read("per_step", "learning_rate")
        ```
        """
        columns = self._layout.columns(table)
        if name not in columns:
            raise KeyError(f"No {table} column {name!r} in '{self.path}'. Available: {columns}")
        file = self._require_open()
        with damage_reported(self.path):
            length = self._length(table)
            stop = length if stop is None else min(stop, length)
            return file[table][name][start:stop]

    def refresh(self) -> None:
        """Makes the rows written since opening (or the last refresh) visible."""
        file = self._require_open()
        if file.swmr_mode:
            with damage_reported(self.path):
                for table in schema.TABLES:
                    for name in self._layout.columns(table):
                        file[table][name].refresh()
        else:
            file.close()
            self._file = None
            self._open()

    def to_pandas(self, kind: str = "per_example") -> "pandas.DataFrame":
        """One table as a `pandas.DataFrame`.

        Per-layer statistics become one column per layer, named `"<stat>/<layer>"`;
        `target_influence` one per target (`"target_influence/<target id>"`) and
        `gradient_sketch` one per position.

        Args:
            kind: `"per_example"` or `"per_step"`.

        Returns:
            The index columns followed by the statistics, one row per example or step.

        Example:

        ```python
        frame = GradientLog("run.h5").to_pandas()
        frame.groupby("epoch")["cosine"].mean()
        ```
        """
        if kind not in schema.TABLES:
            raise ValueError(f"Expected kind in {list(schema.TABLES)}. Received: {kind=}")
        try:
            import pandas
        except ImportError as error:
            raise ImportError(
                "to_pandas() needs pandas. Install it with `pip install keras-gradtrack[pandas]`."
            ) from error
        return pandas.DataFrame(table_columns(self, kind))

    def close(self) -> None:
        """Closes the file. Calling it again does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._file is None:
            return f"<{name} '{self.path}' (closed)>"
        return (
            f"<{name} '{self.path}': {self.num_examples} example rows, "
            f"{self.num_steps} step rows, layers={self.layers}, "
            f"per_example={self.per_example_names}, per_step={self.per_step_names}>"
        )

    def _open(self) -> None:
        file = open_for_reading(self.path)
        try:
            with damage_reported(self.path):
                self._layout = schema.Layout.read(file, self.path)
        except BaseException:
            file.close()
            raise
        self._file = file

    def _require_open(self) -> h5py.File:
        if self._file is None:
            raise ValueError(f"The {type(self).__name__} for '{self.path}' is closed.")
        return self._file

    def _length(self, table: str) -> int:
        file = self._require_open()
        with damage_reported(self.path):
            group = file[table]
            return rows_in_all(group[name] for name in self._layout.columns(table))


def _to_python(value: Any) -> Any:
    """Turns numpy scalars and arrays read from HDF5 attributes into Python values."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return value


def table_columns(log: LogReader, kind: str = "per_example") -> dict[str, np.ndarray]:
    """One table as flat columns; 2-D ones become `"<name>/<label>"` columns (per layer,
    per target, per sketch position: `layout.labels`).

    Example:

    ```python
    columns = table_columns(log, "per_step")  # {"step": ..., "batch_grad_norm": ...}
    ```
    """
    if kind not in schema.TABLES:
        raise ValueError(f"Expected kind in {list(schema.TABLES)}. Received: kind={kind!r}")
    columns: dict[str, np.ndarray] = {}
    for name in log.layout.columns(kind):
        values = log.read(kind, name)
        labels = log.layout.labels(kind, name)
        if labels is None:
            columns[name] = values
        else:
            for label, column in zip(labels, values.T, strict=True):
                columns[f"{name}/{label}"] = column
    return columns
