"""Tables of resizable HDF5 datasets: what a layout declares, and how files hold them.

A layout (see `io.schema`) declares its tables as `Table`s of `Column`s; the
functions here create them in a new file, measure the rows complete in all of a
table's datasets, and cut a file back to the steps complete in every table.
"""

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import h5py
import numpy as np

# Rows allocated but not yet written read as these, never as plausible numbers.
INDEX_FILL_VALUE = -1
STATISTIC_FILL_VALUE = np.nan
COMPRESSIONS = (None, "gzip", "lzf")
GZIP_LEVEL = 4
# SWMR needs the HDF5 1.10 file format; a lower bound of v110 (rather than "latest")
# keeps the files readable by any HDF5 >= 1.10.
LIBVER = ("v110", "latest")


@dataclasses.dataclass(frozen=True)
class Column:
    """One dataset of a table.

    Attributes:
        path: the dataset's path from the root, e.g. `"per_step/step"`.
        dtype: its dtype.
        row_shape: the shape of one row (`()` for one value per row).
        chunks: the chunk shape, rows first.
        streamed: written in parts while a step runs (large tensors) instead of
            being buffered with the other columns.
    """

    path: str
    dtype: np.dtype
    row_shape: tuple[int, ...]
    chunks: tuple[int, ...]
    streamed: bool = False

    @functools.cached_property
    def name(self) -> str:
        """The path without the table's group: how callers name the column."""
        return self.path.split("/", 1)[1]

    @property
    def fill_value(self) -> Any:
        return STATISTIC_FILL_VALUE if self.dtype.kind == "f" else INDEX_FILL_VALUE


@dataclasses.dataclass(frozen=True)
class Table:
    """Datasets that grow together; the first column is the step of each row.

    Attributes:
        columns: the datasets, in creation order.
        rows_per_step: path of the one-row-per-step column that holds how many rows
            of this table each step has (`"per_step/batch_size"`); `None` for one
            row per step.
    """

    columns: tuple[Column, ...]
    rows_per_step: str | None = None

    @property
    def step_column(self) -> Column:
        return self.columns[0]


def create_datasets(
    file: h5py.File,
    attrs: Mapping[str, Mapping[str, Any]],
    tables: Mapping[str, Table],
    compression: str | None,
) -> None:
    """Writes the attributes (group path -> attributes) and every table, empty."""
    for group_path, group_attrs in attrs.items():
        group = file if group_path == "/" else file.require_group(group_path)
        for name, value in group_attrs.items():
            group.attrs[name] = value
    columns = [column for table in tables.values() for column in table.columns]
    parents = dict.fromkeys(c.path.rsplit("/", 1)[0] for c in columns if "/" in c.path)
    for parent in parents:
        parts = parent.split("/")
        for group_path in ("/".join(parts[: n + 1]) for n in range(len(parts))):
            if group_path not in file:
                # Creation order is kept so that readers list columns in the order declared.
                file.create_group(group_path, track_order=True)
    for column in columns:
        h5py.h5d.create(file.id, column.path.encode(), *_creation_properties(column, compression))


@functools.cache
def _creation_properties(column: Column, compression: str | None) -> tuple[Any, Any, Any]:
    """The type, space (empty, resizable) and creation property list of `column`.

    What h5py's `create_dataset` would make from the column's declaration, made
    once per process rather than for every dataset of every file (HDF5 copies them
    into each dataset): a new log's header and 17 datasets take 0.6 ms instead of 1.5.
    """
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_chunk(column.chunks)
    if compression is not None:
        plist.set_shuffle()
        if compression == "gzip":
            plist.set_deflate(GZIP_LEVEL)
        else:
            plist.set_filter(h5py.h5z.FILTER_LZF, h5py.h5z.FLAG_OPTIONAL)
    plist.set_fill_value(np.array(column.fill_value, dtype=column.dtype))
    plist.set_obj_track_times(False)
    space = h5py.h5s.create_simple((0, *column.row_shape), (h5py.h5s.UNLIMITED, *column.row_shape))
    return h5py.h5t.py_create(column.dtype, logical=True), space, plist


def rows_in_all(datasets: Iterable[h5py.Dataset]) -> int:
    """Rows present in every one of `datasets` (0 for none).

    A reader may look while a block is being written, when some datasets of a
    table are already longer than others; only the common rows are complete.
    """
    return min((dataset.shape[0] for dataset in datasets), default=0)


def drop_incomplete_rows(file: h5py.File, tables: Mapping[str, Table]) -> int:
    """Cuts every table back to the last step complete in all of them; returns the steps.

    A writer killed in the middle of a block can leave some datasets longer than
    others; appending after them would misalign the columns.
    """
    datasets = {name: [file[c.path] for c in table.columns] for name, table in tables.items()}
    num_steps = min(
        rows_in_all(datasets[name]) for name, table in tables.items() if table.rows_per_step is None
    )
    rows_through_step: dict[str, np.ndarray] = {}
    for name, table in tables.items():
        if table.rows_per_step is not None:
            counts = file[table.rows_per_step][:num_steps]
            rows_through_step[name] = np.cumsum(counts, dtype=np.int64)
            complete = np.searchsorted(
                rows_through_step[name], rows_in_all(datasets[name]), side="right"
            )
            num_steps = min(num_steps, int(complete))
    for name, table in tables.items():
        if table.rows_per_step is None:
            length = num_steps
        else:
            length = int(rows_through_step[name][num_steps - 1]) if num_steps else 0
        for dataset in datasets[name]:
            if dataset.shape[0] != length:
                dataset.resize(length, axis=0)
    return num_steps


def read_version(
    file: h5py.File, path: str, description: str, attr: str, supported: Sequence[int]
) -> int:
    """The file's version attribute `attr`.

    Raises:
        ValueError: if the file has no such attribute, or a version not in `supported`.
    """
    if attr not in file.attrs:
        raise ValueError(f"'{path}' is not a {description}: it has no root attribute '{attr}'.")
    version = file.attrs[attr]
    if isinstance(version, np.generic | np.ndarray):
        version = version.tolist()
    if not isinstance(version, int) or version not in supported:
        raise ValueError(
            f"'{path}' has an unsupported schema version. Expected {attr} in "
            f"{list(supported)}. Received: {attr}={version!r}. It may have been written by "
            "a newer keras_gradtrack."
        )
    return version


def required_groups(
    file: h5py.File, path: str, description: str, names: Sequence[str]
) -> dict[str, h5py.Group]:
    """The groups `names` of `file`; a ValueError if one is missing (not a `description`)."""
    groups = {name: member(file, name) for name in names}
    for name, group in groups.items():
        if not isinstance(group, h5py.Group):
            raise ValueError(f"'{path}' is not a {description}: it has no group '/{name}'.")
    return groups


def member(group: h5py.Group, name: str) -> Any:
    """`group[name]`, or None if there is no such member.

    Not `group.get(name)`: it would report a member HDF5 cannot read in a damaged
    file as a missing one.
    """
    if name not in group:
        return None
    return group[name]
