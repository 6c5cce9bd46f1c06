"""The two file layouts keras_gradtrack writes, declared as data.

Every name, dtype, shape and attribute of a log is defined here once; the writer
(`io.block_writer`) creates and fills whatever a layout declares, and the readers
look names up here.

The gradient log (`HDF5GradientLogger`, schema version 1):

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
/per_step/learning_rate float32 (S,)     reserved: the rate the optimizer used
/per_step/<stat>        float32 (S,) or (S, L)
/layers                 attrs: names = the L layer names, in column order
```

The output-gradient log (`OutputGradientLogger`, output_gradients_schema_version 1):

```
/                       attrs: output_gradients_schema_version=1, library_version,
                               keras_version, tensorflow_version, created, model_name,
                               num_features (F), axis
/per_step/step          int64   (S,)
/per_step/epoch         int32   (S,)
/per_step/output_grad_norm              float32 (S, F, L)
/output_gradients/<layer>/<variable>    float32 (S, F) + variable.shape   (save_tensors)
/layers                 attrs: names = the L layer names, in column order
```

A *table* is a set of datasets that grow together: row r of each describes the
same example (or step). Every dataset is resizable along its first axis, chunked
along it and compressed; rows allocated but not yet written read as fill values
(-1, NaN), never as plausible numbers.
"""

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import h5py
import numpy as np

from keras_gradtrack.io.checks import check_layer_names
from keras_gradtrack.io.hdf5_tables import Column, Table, member, read_version, required_groups

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION,)
SCHEMA_VERSION_ATTR = "schema_version"
OUTPUT_GRADIENTS_SCHEMA_VERSION = 1
OUTPUT_GRADIENTS_SCHEMA_VERSION_ATTR = "output_gradients_schema_version"

PER_EXAMPLE_GROUP = "per_example"
PER_STEP_GROUP = "per_step"
TABLES = (PER_EXAMPLE_GROUP, PER_STEP_GROUP)
LAYERS_GROUP = "layers"
LAYER_NAMES_ATTR = "names"
OUTPUT_GRADIENTS_GROUP = "output_gradients"

STEP = "step"
EPOCH = "epoch"
EXAMPLE_ID = "example_id"
BATCH_SIZE = "batch_size"
# Index columns of each table of the gradient log, in the order they are created.
INDEX_COLUMNS: dict[str, dict[str, np.dtype]] = {
    PER_EXAMPLE_GROUP: {
        STEP: np.dtype("int64"),
        EPOCH: np.dtype("int32"),
        EXAMPLE_ID: np.dtype("int64"),
    },
    PER_STEP_GROUP: {
        STEP: np.dtype("int64"),
        EPOCH: np.dtype("int32"),
        BATCH_SIZE: np.dtype("int32"),
    },
}
# The learning rate the optimizer used at each tracked step (for TracIn-style
# influence): a per-step value column the logger writes, not a statistic.
LEARNING_RATE = "learning_rate"
# Names no user statistic may take: they are columns the logger writes itself.
RESERVED_NAMES = (STEP, EPOCH, EXAMPLE_ID, BATCH_SIZE, LEARNING_RATE)
STATISTIC_DTYPE = np.dtype("float32")

OUTPUT_GRAD_NORM = "output_grad_norm"
NUM_FEATURES_ATTR = "num_features"
AXIS_ATTR = "axis"

CREATED_ATTR = "created"
# Root attributes the caller provides; the writer adds the version and `created`.
CALLER_ATTRS = ("library_version", "keras_version", "tensorflow_version", "model_name")
ROOT_ATTRS = (SCHEMA_VERSION_ATTR, *CALLER_ATTRS, CREATED_ATTR)

CHUNK_ROWS = {PER_EXAMPLE_GROUP: 4096, PER_STEP_GROUP: 256}
MAX_CHUNK_BYTES = 1 << 20


def chunk_rows(table: str, width: int | None, itemsize: int) -> int:
    """Rows per chunk for a dataset of `table`, capped so a chunk is at most 1 MiB."""
    row_bytes = itemsize * (width or 1)
    return max(1, min(CHUNK_ROWS[table], MAX_CHUNK_BYTES // row_bytes))


def _column(table: str, name: str, dtype: np.dtype, width: int | None) -> Column:
    row_shape = () if width is None else (width,)
    rows = chunk_rows(table, width, dtype.itemsize)
    return Column(f"{table}/{name}", dtype, row_shape, (rows, *row_shape))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A gradient log: layer names and, per table, value column name -> width.

    A width is `None` for a column of shape (rows,) and L for (rows, L). The value
    columns are the statistics and, in `per_step`, the reserved `learning_rate`.

    Attributes:
        layer_names: the L layer names, in the column order of per-layer statistics.
        per_example: per-example value columns, in file order.
        per_step: per-step value columns, in file order.
    """

    layer_names: list[str]
    per_example: dict[str, int | None]
    per_step: dict[str, int | None]

    description = "keras_gradtrack log"
    version_attr = SCHEMA_VERSION_ATTR
    version = SCHEMA_VERSION

    @classmethod
    def from_arguments(
        cls,
        layer_names: Sequence[str],
        per_example: Mapping[str, int | None],
        per_step: Mapping[str, int | None],
    ) -> "Layout":
        """Validates the layout given to a writer.

        Raises:
            ValueError: for layer names that are not unique strings, column names
                that are empty, hold '/' or name an index column, a `learning_rate`
                other than one value per step, or widths other than `None` and
                `len(layer_names)`.
        """
        check_layer_names(layer_names)
        num_layers = len(layer_names)
        for table, widths in ((PER_EXAMPLE_GROUP, per_example), (PER_STEP_GROUP, per_step)):
            index_columns = list(INDEX_COLUMNS[table])
            for name, width in widths.items():
                if not isinstance(name, str) or not name or "/" in name or name in index_columns:
                    raise ValueError(
                        f"Expected {table} names to be non-empty strings without '/', other "
                        f"than the index columns {index_columns}. Received: {table}={dict(widths)}"
                    )
                if name == LEARNING_RATE and (table != PER_STEP_GROUP or width is not None):
                    raise ValueError(
                        f"'{LEARNING_RATE}' is reserved for the per-step learning rate (one "
                        f"value per step, width None). Received: {table}={dict(widths)}"
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
        """The value columns of `table` (`"per_example"` or `"per_step"`) and their widths."""
        if table not in TABLES:
            raise ValueError(f"Expected table in {list(TABLES)}. Received: table={table!r}")
        return self.per_example if table == PER_EXAMPLE_GROUP else self.per_step

    def columns(self, table: str) -> list[str]:
        """Every column of `table` in file order: the index columns, then the values."""
        return [*INDEX_COLUMNS[table], *self.widths(table)]

    def tables(self) -> dict[str, Table]:
        """The datasets to create, per table; per-example rows number `batch_size` per step."""
        tables = {}
        for table in TABLES:
            columns = [_column(table, n, dtype, None) for n, dtype in INDEX_COLUMNS[table].items()]
            columns += [
                _column(table, name, STATISTIC_DTYPE, width)
                for name, width in self.widths(table).items()
            ]
            rows_per_step = f"{PER_STEP_GROUP}/{BATCH_SIZE}" if table == PER_EXAMPLE_GROUP else None
            tables[table] = Table(tuple(columns), rows_per_step)
        return tables

    def layout_attrs(self) -> dict[str, Any]:
        """Root attributes that belong to the layout (compared when appending): none."""
        return {}

    @classmethod
    def read(cls, file: h5py.File, path: str) -> "Layout":
        """Checks that `file` is a gradient log this version reads; returns its layout.

        Raises:
            ValueError: if the file is not a keras_gradtrack log, or has an
                unsupported `schema_version`.
        """
        if (
            SCHEMA_VERSION_ATTR not in file.attrs
            and OUTPUT_GRADIENTS_SCHEMA_VERSION_ATTR in file.attrs
        ):
            raise ValueError(
                f"'{path}' is an output-gradient log (OutputGradientLogger), not a gradient "
                "log: read it with h5py (see the schema in docs/schema.md)."
            )
        read_version(file, path, cls.description, SCHEMA_VERSION_ATTR, SUPPORTED_SCHEMA_VERSIONS)
        groups = required_groups(file, path, cls.description, (*TABLES, LAYERS_GROUP))
        widths: dict[str, dict[str, int | None]] = {}
        for table in TABLES:
            group = groups[table]
            missing = [name for name in INDEX_COLUMNS[table] if name not in group]
            if missing:
                raise ValueError(
                    f"'{path}' is not a {cls.description}: '/{table}' lacks the index "
                    f"datasets {missing}."
                )
            widths[table] = {
                name: (dataset.shape[1] if dataset.ndim == 2 else None)
                for name, dataset in group.items()
                if name not in INDEX_COLUMNS[table]
            }
        return cls(
            _layer_names(groups[LAYERS_GROUP]), widths[PER_EXAMPLE_GROUP], widths[PER_STEP_GROUP]
        )


@dataclasses.dataclass(frozen=True)
class OutputGradientLayout:
    """An output-gradient log: for F output features and L layers, per logged step.

    Attributes:
        layer_names: the L layers with variables of their own, in column order.
        num_features: F, the size of the model output along `axis`.
        axis: the output axis that enumerates the features.
        variables: layer name -> variable name -> shape, for the full gradient
            tensors (`save_tensors=True`); empty otherwise.
        chunk_size: features per compiled call; the tensors are chunked alike.
    """

    layer_names: list[str]
    num_features: int
    axis: int
    variables: dict[str, dict[str, tuple[int, ...]]]
    chunk_size: int = dataclasses.field(default=16, compare=False)

    description = "keras_gradtrack output-gradient log"
    version_attr = OUTPUT_GRADIENTS_SCHEMA_VERSION_ATTR
    version = OUTPUT_GRADIENTS_SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_layer_names(self.layer_names)
        unknown = sorted(set(self.variables) - set(self.layer_names))
        if unknown:
            raise ValueError(
                f"Expected the variables of layers in {self.layer_names}. Received: {unknown}"
            )
        for layer, variables in self.variables.items():
            if any(not name or "/" in name for name in variables):
                raise ValueError(
                    f"Expected variable names without '/'. Received: layer {layer!r}: "
                    f"{list(variables)}"
                )

    def tables(self) -> dict[str, Table]:
        """One table, one row per logged step: the norms, and the tensors if saved."""
        features, layers = self.num_features, len(self.layer_names)
        columns = [
            _column(PER_STEP_GROUP, STEP, INDEX_COLUMNS[PER_STEP_GROUP][STEP], None),
            _column(PER_STEP_GROUP, EPOCH, INDEX_COLUMNS[PER_STEP_GROUP][EPOCH], None),
            Column(
                f"{PER_STEP_GROUP}/{OUTPUT_GRAD_NORM}",
                STATISTIC_DTYPE,
                (features, layers),
                (1, features, layers),
            ),
        ]
        # The tensors are written chunk by chunk while the step runs, so memory grows
        # with a chunk of features, never with all of them.
        chunk = min(self.chunk_size, features)
        for layer in self.layer_names:
            for name, shape in self.variables.get(layer, {}).items():
                path = self.tensor_path(layer, name)
                row_shape = (features, *shape)
                columns.append(
                    Column(path, STATISTIC_DTYPE, row_shape, (1, chunk, *shape), streamed=True)
                )
        return {PER_STEP_GROUP: Table(tuple(columns))}

    def layout_attrs(self) -> dict[str, Any]:
        """Root attributes that belong to the layout (compared when appending)."""
        return {NUM_FEATURES_ATTR: self.num_features, AXIS_ATTR: self.axis}

    @staticmethod
    def tensor_path(layer: str, variable: str) -> str:
        """The dataset of one variable's per-feature gradients."""
        return f"{OUTPUT_GRADIENTS_GROUP}/{layer}/{variable}"

    @classmethod
    def read(cls, file: h5py.File, path: str) -> "OutputGradientLayout":
        """Checks that `file` is an output-gradient log this version reads; returns its layout.

        Raises:
            ValueError: if the file is not an output-gradient log of a supported version.
        """
        read_version(
            file, path, cls.description, cls.version_attr, (OUTPUT_GRADIENTS_SCHEMA_VERSION,)
        )
        groups = required_groups(file, path, cls.description, (PER_STEP_GROUP, LAYERS_GROUP))
        variables: dict[str, dict[str, tuple[int, ...]]] = {}
        if OUTPUT_GRADIENTS_GROUP in file:
            tensors = file[OUTPUT_GRADIENTS_GROUP]
            for layer, group in tensors.items():
                variables[layer] = {name: d.shape[2:] for name, d in group.items()}
        steps = groups[PER_STEP_GROUP]
        norms = member(steps, OUTPUT_GRAD_NORM)
        if not isinstance(norms, h5py.Dataset) or norms.ndim != 3:
            raise ValueError(
                f"'{path}' is not a {cls.description}: it has no 3-D "
                f"'/{PER_STEP_GROUP}/{OUTPUT_GRAD_NORM}'."
            )
        return cls(
            _layer_names(groups[LAYERS_GROUP]),
            int(file.attrs.get(NUM_FEATURES_ATTR, norms.shape[1])),
            int(file.attrs.get(AXIS_ATTR, -1)),
            variables,
            norms.chunks[1] if norms.chunks else norms.shape[1],
        )


def header(
    layout: "Layout | OutputGradientLayout", attrs: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The attributes of a new file of `layout`, per group path (`"/"`: the root).

    Args:
        layout: the file's layout.
        attrs: the caller's root attributes (see `checked_caller_attrs`).
    """
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    names = np.array(layout.layer_names, dtype=h5py.string_dtype())
    return {
        "/": {
            layout.version_attr: layout.version,
            **attrs,
            CREATED_ATTR: created,
            **layout.layout_attrs(),
        },
        LAYERS_GROUP: {LAYER_NAMES_ATTR: names},
    }


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
    written = (
        SCHEMA_VERSION_ATTR,
        OUTPUT_GRADIENTS_SCHEMA_VERSION_ATTR,
        CREATED_ATTR,
        NUM_FEATURES_ATTR,
        AXIS_ATTR,
    )
    reserved = [name for name in written if name in attrs]
    if reserved:
        raise ValueError(
            f"The writer sets the attributes {reserved} itself; leave them out of attrs. "
            f"Received: attrs={dict(attrs)}"
        )
    return dict(attrs)


def _layer_names(group: h5py.Group) -> list[str]:
    names = group.attrs.get(LAYER_NAMES_ATTR, np.array([], dtype=object))
    return [name.decode() if isinstance(name, bytes) else str(name) for name in names]
