"""The two file layouts keras_gradtrack writes, declared as data.

Every name, dtype, shape and attribute of a log is defined here once; the writer
(`io.block_writer`) creates and fills whatever a layout declares, and the readers
look names up here.

The gradient log (`HDF5GradientLogger`, schema version 2; version 1 lacks the
attribution columns and groups, and is read too):

```
/                       attrs: schema_version=2, library_version, keras_version,
                               tensorflow_version, created (ISO 8601, UTC), model_name
/per_example/step       int64   (N,)     global step of the row
/per_example/epoch      int32   (N,)
/per_example/example_id int64   (N,)
/per_example/<stat>     float32 (N,) or (N, L)
/per_example/target_influence  float32 (N, T)   with targets: lr_t <g_i, g_target_j>
/per_example/gradient_sketch   float32 (N, K)   with sketches: the sketch of g_i
/per_step/step          int64   (S,)
/per_step/epoch         int32   (S,)
/per_step/batch_size    int32   (S,)
/per_step/learning_rate float32 (S,)     reserved: the rate the optimizer used
/per_step/<stat>        float32 (S,) or (S, L)
/layers                 attrs: names = the L layer names, in column order
/targets                attrs: example_ids = the T target ids, in column order
/sketch                 attrs: dim, seed, variables, widths (see `SketchLayout`)
```

The output-gradient log (`OutputGradientLogger`) is declared in `io.output_schema`
with the names defined here.

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

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, SCHEMA_VERSION)
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
# Attribution (schema version 2): per example row, `lr_t <g_i, g_target_j>` for the T
# targets of `/targets`, and the K numbers of the gradient sketch of `/sketch`.
TARGET_INFLUENCE = "target_influence"
GRADIENT_SKETCH = "gradient_sketch"
TARGETS_GROUP = "targets"
TARGET_IDS_ATTR = "example_ids"
SKETCH_GROUP = "sketch"
# Names no user statistic may take: they are columns the logger writes itself.
RESERVED_NAMES = (
    STEP,
    EPOCH,
    EXAMPLE_ID,
    BATCH_SIZE,
    LEARNING_RATE,
    TARGET_INFLUENCE,
    GRADIENT_SKETCH,
)
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


def table_column(table: str, name: str, dtype: np.dtype, width: int | None) -> Column:
    """The declaration of one column of `table`: (rows,) or (rows, width), chunked by rows."""
    row_shape = () if width is None else (width,)
    rows = chunk_rows(table, width, dtype.itemsize)
    return Column(f"{table}/{name}", dtype, row_shape, (rows, *row_shape))


@dataclasses.dataclass(frozen=True)
class SketchLayout:
    """How the gradient sketches of a log are made: the attributes of `/sketch`.

    Each sketched variable's gradient, as a (rows, cols) matrix (cols its last
    axis), is projected to `R^T g C`: R (rows, min(rows, dim)) and C (cols,
    min(cols, dim)) Gaussian, drawn from `seed`; a side no larger than `dim` is
    kept as it is.

    Attributes:
        dim: the most dimensions a side is projected to.
        seed: the seed of the projections.
        variables: paths of the sketched variables, in column order.
        widths: each variable's sketch size, `r_in * r_out` (K is their sum).
    """

    dim: int
    seed: int
    variables: tuple[str, ...]
    widths: tuple[int, ...]

    def attrs(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "seed": self.seed,
            "variables": np.array(self.variables, dtype=h5py.string_dtype()),
            "widths": np.array(self.widths, dtype=np.int64),
        }

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "SketchLayout":
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in attrs["variables"]]
        widths = tuple(int(w) for w in attrs["widths"])
        return cls(int(attrs["dim"]), int(attrs["seed"]), tuple(names), widths)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A gradient log: layer names and, per table, value column name -> width.

    A width is `None` for a column of shape (rows,) and L for (rows, L); the
    reserved `target_influence` has one column per target, `gradient_sketch` K.
    The value columns are the statistics and the reserved columns.

    Attributes:
        layer_names: the L layer names, in the column order of per-layer statistics.
        per_example: per-example value columns, in file order.
        per_step: per-step value columns, in file order.
        target_ids: the ids of the targets of `target_influence`, in column order.
        sketch: how `gradient_sketch` is made, if the log holds sketches.
    """

    layer_names: list[str]
    per_example: dict[str, int | None]
    per_step: dict[str, int | None]
    target_ids: tuple[int, ...] = ()
    sketch: SketchLayout | None = None

    description = "keras_gradtrack log"
    version_attr = SCHEMA_VERSION_ATTR
    version = SCHEMA_VERSION

    @classmethod
    def from_arguments(
        cls,
        layer_names: Sequence[str],
        per_example: Mapping[str, int | None],
        per_step: Mapping[str, int | None],
        target_ids: Sequence[int] = (),
        sketch: SketchLayout | None = None,
    ) -> "Layout":
        """Validates the layout given to a writer.

        Raises:
            ValueError: for layer names that are not unique strings, column names
                that are empty, hold '/' or name an index column, a `learning_rate`
                other than one value per step, widths other than `None` and
                `len(layer_names)`, or reserved attribution columns that do not
                match `target_ids` and `sketch`.
        """
        check_layer_names(layer_names)
        target_ids = tuple(int(i) for i in target_ids)
        attribution = {TARGET_INFLUENCE: len(target_ids) or None}
        attribution[GRADIENT_SKETCH] = sum(sketch.widths) if sketch else None
        for name, width in attribution.items():
            if per_example.get(name) != width or (width is None) == (name in per_example):
                raise ValueError(
                    f"Expected '{name}' among the per_example columns with width {width} "
                    f"(as the targets and sketch say) or, for None, not at all. Received: "
                    f"per_example={dict(per_example)}, {len(target_ids)} targets, {sketch=}"
                )
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
                if name in attribution and table == PER_EXAMPLE_GROUP:
                    continue
                if width is not None and (
                    isinstance(width, bool) or width != num_layers or num_layers == 0
                ):
                    raise ValueError(
                        f"Expected each width in {table} to be None (one value per row) or "
                        f"len(layer_names)={num_layers} (one value per layer). "
                        f"Received: {table}={dict(widths)}"
                    )
        return cls(list(layer_names), dict(per_example), dict(per_step), target_ids, sketch)

    def widths(self, table: str) -> dict[str, int | None]:
        """The value columns of `table` (`"per_example"` or `"per_step"`) and their widths."""
        if table not in TABLES:
            raise ValueError(f"Expected table in {list(TABLES)}. Received: table={table!r}")
        return self.per_example if table == PER_EXAMPLE_GROUP else self.per_step

    def columns(self, table: str) -> list[str]:
        """Every column of `table` in file order: the index columns, then the values."""
        return [*INDEX_COLUMNS[table], *self.widths(table)]

    def per_layer(self, table: str) -> list[str]:
        """The value columns of `table` with one column per layer, in file order."""
        return [
            name
            for name, width in self.widths(table).items()
            if width is not None and name not in (TARGET_INFLUENCE, GRADIENT_SKETCH)
        ]

    def labels(self, table: str, name: str) -> list[str] | None:
        """What the columns of a 2-D dataset are: layer names, target ids or sketch
        positions; None for a dataset of one value per row."""
        width = self.widths(table).get(name)
        if width is None:
            return None
        if table == PER_EXAMPLE_GROUP and name == TARGET_INFLUENCE:
            return [str(target) for target in self.target_ids]
        if table == PER_EXAMPLE_GROUP and name == GRADIENT_SKETCH:
            return [str(position) for position in range(width)]
        return list(self.layer_names)

    def tables(self) -> dict[str, Table]:
        """The datasets to create, per table; per-example rows number `batch_size` per step."""
        tables = {}
        for table in TABLES:
            columns = [
                table_column(table, n, dtype, None) for n, dtype in INDEX_COLUMNS[table].items()
            ]
            columns += [
                table_column(table, name, STATISTIC_DTYPE, width)
                for name, width in self.widths(table).items()
            ]
            rows_per_step = f"{PER_STEP_GROUP}/{BATCH_SIZE}" if table == PER_EXAMPLE_GROUP else None
            tables[table] = Table(tuple(columns), rows_per_step)
        return tables

    def layout_attrs(self) -> dict[str, Any]:
        """Root attributes that belong to the layout (compared when appending): none."""
        return {}

    def group_attrs(self) -> dict[str, dict[str, Any]]:
        """The attribution groups' attributes: `/targets`, `/sketch`, when the log has them."""
        groups: dict[str, dict[str, Any]] = {}
        if self.target_ids:
            groups[TARGETS_GROUP] = {TARGET_IDS_ATTR: np.array(self.target_ids, np.int64)}
        if self.sketch is not None:
            groups[SKETCH_GROUP] = self.sketch.attrs()
        return groups

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
        targets = member(file, TARGETS_GROUP)
        target_ids = () if targets is None else tuple(targets.attrs[TARGET_IDS_ATTR].tolist())
        sketch = member(file, SKETCH_GROUP)
        return cls(
            layer_names_of(groups[LAYERS_GROUP]),
            widths[PER_EXAMPLE_GROUP],
            widths[PER_STEP_GROUP],
            target_ids,
            None if sketch is None else SketchLayout.from_attrs(sketch.attrs),
        )


def header(layout: Any, attrs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
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
        **layout.group_attrs(),
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


def layer_names_of(group: h5py.Group) -> list[str]:
    """The layer names stored in the attributes of `group` (`/layers`)."""
    names = group.attrs.get(LAYER_NAMES_ATTR, np.array([], dtype=object))
    return [name.decode() if isinstance(name, bytes) else str(name) for name in names]
