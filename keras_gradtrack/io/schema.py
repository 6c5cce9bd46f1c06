"""Layout of a keras_gradtrack log file, shared by `LogWriter` and `GradientLog`.

Schema version 1:

```
/                       attrs: schema_version=1, library_version, keras_version,
                               tensorflow_version, created (ISO 8601, UTC), model_name
/per_example/step       int64   (N,)     global step of the row
/per_example/epoch      int32   (N,)
/per_example/example_id int64   (N,)
/per_example/<stat>     float32 (N,) or (N, L)
/per_step/step          int64   (S,)
/per_step/epoch         int32   (S,)
/per_step/batch_size    int32   (S,)
/per_step/<stat>        float32 (S,) or (S, L)
/layers                 attrs: names = the L layer names, in column order
```

Every dataset is resizable along its first axis, chunked along rows and compressed.
"""

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import h5py
import numpy as np

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION,)

PER_EXAMPLE_GROUP = "per_example"
PER_STEP_GROUP = "per_step"
TABLES = (PER_EXAMPLE_GROUP, PER_STEP_GROUP)
LAYERS_GROUP = "layers"
LAYER_NAMES_ATTR = "names"

# Index columns of each table, in the order they are created, with their dtypes.
INDEX_COLUMNS: dict[str, dict[str, np.dtype]] = {
    PER_EXAMPLE_GROUP: {
        "step": np.dtype("int64"),
        "epoch": np.dtype("int32"),
        "example_id": np.dtype("int64"),
    },
    PER_STEP_GROUP: {
        "step": np.dtype("int64"),
        "epoch": np.dtype("int32"),
        "batch_size": np.dtype("int32"),
    },
}
STATISTIC_DTYPE = np.dtype("float32")
# Rows allocated but not yet written read as these, never as plausible numbers.
INDEX_FILL_VALUE = -1
STATISTIC_FILL_VALUE = np.nan

SCHEMA_VERSION_ATTR = "schema_version"
CREATED_ATTR = "created"
# Root attributes the caller provides; the writer adds `schema_version` and `created`.
CALLER_ATTRS = ("library_version", "keras_version", "tensorflow_version", "model_name")
ROOT_ATTRS = (SCHEMA_VERSION_ATTR, *CALLER_ATTRS, CREATED_ATTR)

CHUNK_ROWS = {PER_EXAMPLE_GROUP: 4096, PER_STEP_GROUP: 256}
MAX_CHUNK_BYTES = 1 << 20
COMPRESSIONS = (None, "gzip", "lzf")
GZIP_LEVEL = 4
# SWMR needs the HDF5 1.10 file format; a lower bound of v110 (rather than "latest")
# keeps the files readable by any HDF5 >= 1.10.
LIBVER = ("v110", "latest")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a log holds: layer names and, per table, statistic name -> width.

    A width is `None` for a statistic of shape (rows,) and L for (rows, L).
    """

    layer_names: list[str]
    per_example: dict[str, int | None]
    per_step: dict[str, int | None]

    @classmethod
    def from_arguments(
        cls,
        layer_names: Sequence[str],
        per_example: Mapping[str, int | None],
        per_step: Mapping[str, int | None],
    ) -> "Layout":
        """Validates the layout given to a writer.

        Raises:
            ValueError: for layer names that are not unique strings, statistic names
                that are empty, hold '/' or name an index column, or widths other
                than `None` and `len(layer_names)`.
        """
        if isinstance(layer_names, str) or not all(isinstance(n, str) for n in layer_names):
            raise ValueError(
                f"Expected layer_names to be a sequence of strings. Received: {layer_names=}"
            )
        if len(set(layer_names)) != len(layer_names):
            raise ValueError(f"Expected unique layer names. Received: {layer_names=}")
        num_layers = len(layer_names)
        for table, widths in ((PER_EXAMPLE_GROUP, per_example), (PER_STEP_GROUP, per_step)):
            index_columns = list(INDEX_COLUMNS[table])
            for name, width in widths.items():
                if not isinstance(name, str) or not name or "/" in name or name in index_columns:
                    raise ValueError(
                        f"Expected {table} names to be non-empty strings without '/', other "
                        f"than the index columns {index_columns}. Received: {table}={dict(widths)}"
                    )
                if width is not None and (
                    isinstance(width, bool) or width != num_layers or num_layers == 0
                ):
                    raise ValueError(
                        f"Expected each width in {table} to be None (one value per row) or "
                        f"len(layer_names)={num_layers} (one value per layer). "
                        f"Received: {table}={dict(widths)}"
                    )
        return cls(list(layer_names), dict(per_example), dict(per_step))

    def widths(self, table: str) -> dict[str, int | None]:
        return self.per_example if table == PER_EXAMPLE_GROUP else self.per_step

    def checked_values(
        self, table: str, values: Mapping[str, Any], leading_shape: tuple[int, ...]
    ) -> dict[str, np.ndarray]:
        """Checks one step's statistics of `table`; returns them as float32 copies.

        Raises:
            ValueError: if the names differ from the declared ones or a shape is not
                `leading_shape`, followed by L for a per-layer statistic.
        """
        widths = self.widths(table)
        if set(values) != set(widths):
            raise ValueError(
                f"Expected {table} to hold exactly the declared statistics {sorted(widths)}. "
                f"Received: {sorted(values)}"
            )
        checked = {}
        for name, width in widths.items():
            array = np.asarray(values[name])
            expected = leading_shape if width is None else (*leading_shape, width)
            if array.shape != expected:
                raise ValueError(
                    f"Expected {table}['{name}'] to have shape {expected} "
                    f"(B = len(example_ids), L = len(layer_names)). Received: shape={array.shape}"
                )
            # Values beyond float32's range are stored as inf, like NaN as NaN: no warning.
            with np.errstate(over="ignore", invalid="ignore"):
                checked[name] = array.astype(STATISTIC_DTYPE)
        return checked


def checked_caller_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Checks the root attributes given to a writer; returns a copy.

    Raises:
        ValueError: if one of `CALLER_ATTRS` is missing or not a string, or `attrs`
            holds one of the attributes the writer sets.
    """
    if not all(isinstance(attrs.get(name), str) for name in CALLER_ATTRS):
        raise ValueError(
            f"Expected attrs to hold the strings {list(CALLER_ATTRS)}. Received: attrs={dict(attrs)}"
        )
    reserved = [name for name in (SCHEMA_VERSION_ATTR, CREATED_ATTR) if name in attrs]
    if reserved:
        raise ValueError(
            f"The writer sets the attributes {reserved} itself; leave them out of attrs. "
            f"Received: attrs={dict(attrs)}"
        )
    return dict(attrs)


def chunk_rows(table: str, width: int | None, itemsize: int) -> int:
    """Rows per chunk for a dataset of `table`, capped so a chunk is at most 1 MiB."""
    row_bytes = itemsize * (width or 1)
    return max(1, min(CHUNK_ROWS[table], MAX_CHUNK_BYTES // row_bytes))


def create_log(
    file: h5py.File, layout: Layout, attrs: Mapping[str, Any], compression: str | None
) -> None:
    """Writes the root attributes, `/layers` and every (empty) dataset into a new file."""
    file.attrs[SCHEMA_VERSION_ATTR] = SCHEMA_VERSION
    for name, value in attrs.items():
        file.attrs[name] = value
    file.attrs[CREATED_ATTR] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
    layers = file.create_group(LAYERS_GROUP)
    layers.attrs[LAYER_NAMES_ATTR] = np.array(layout.layer_names, dtype=h5py.string_dtype())
    filters: dict[str, Any] = {}
    if compression is not None:
        filters = {"compression": compression, "shuffle": True}
        if compression == "gzip":
            filters["compression_opts"] = GZIP_LEVEL
    for table in TABLES:
        # Creation order is kept so that readers list statistics in the order declared.
        group = file.create_group(table, track_order=True)
        columns: list[tuple[str, np.dtype, int | None]] = [
            (name, dtype, None) for name, dtype in INDEX_COLUMNS[table].items()
        ]
        columns += [(name, STATISTIC_DTYPE, width) for name, width in layout.widths(table).items()]
        for name, dtype, width in columns:
            row_shape = () if width is None else (width,)
            group.create_dataset(
                name,
                shape=(0, *row_shape),
                maxshape=(None, *row_shape),
                dtype=dtype,
                chunks=(chunk_rows(table, width, dtype.itemsize), *row_shape),
                fillvalue=STATISTIC_FILL_VALUE if dtype.kind == "f" else INDEX_FILL_VALUE,
                **filters,
            )


def table_length(group: h5py.Group) -> int:
    """Rows present in every dataset of a table.

    A reader may look while a block is being written, when some datasets of the
    table are already longer than others; only the common rows are complete.
    """
    return min((dataset.shape[0] for dataset in group.values()), default=0)


def read_layout(file: h5py.File, path: str) -> Layout:
    """Checks that `file` is a keras_gradtrack log this version reads; returns its layout.

    Raises:
        ValueError: if the file is not a keras_gradtrack log, or has an unsupported
            `schema_version`.
    """
    if SCHEMA_VERSION_ATTR not in file.attrs:
        raise ValueError(
            f"'{path}' is not a keras_gradtrack log: it has no root attribute "
            f"'{SCHEMA_VERSION_ATTR}'."
        )
    version = file.attrs[SCHEMA_VERSION_ATTR]
    if isinstance(version, np.generic | np.ndarray):
        version = version.tolist()
    if not isinstance(version, int) or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ValueError(
            f"'{path}' has an unsupported schema version. Expected {SCHEMA_VERSION_ATTR} "
            f"in {list(SUPPORTED_SCHEMA_VERSIONS)}. Received: {SCHEMA_VERSION_ATTR}={version!r}. "
            "It may have been written by a newer keras_gradtrack."
        )
    for name in (*TABLES, LAYERS_GROUP):
        if not isinstance(file.get(name), h5py.Group):
            raise ValueError(f"'{path}' is not a keras_gradtrack log: it has no group '/{name}'.")
    widths: dict[str, dict[str, int | None]] = {}
    for table in TABLES:
        group = file[table]
        missing = [name for name in INDEX_COLUMNS[table] if name not in group]
        if missing:
            raise ValueError(
                f"'{path}' is not a keras_gradtrack log: '/{table}' lacks the index "
                f"datasets {missing}."
            )
        widths[table] = {
            name: (dataset.shape[1] if dataset.ndim == 2 else None)
            for name, dataset in group.items()
            if name not in INDEX_COLUMNS[table]
        }
    names = file[LAYERS_GROUP].attrs.get(LAYER_NAMES_ATTR, np.array([], dtype=object))
    return Layout([str(name) for name in names], widths[PER_EXAMPLE_GROUP], widths[PER_STEP_GROUP])
