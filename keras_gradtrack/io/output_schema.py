"""The layout of the output-gradient log (`OutputGradientLogger`), declared as data.

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

The names and the helpers shared with the gradient log are in `io.schema`.
"""

import dataclasses
from typing import Any

import h5py

from keras_gradtrack.io.checks import check_layer_names
from keras_gradtrack.io.hdf5_tables import Column, Table, member, read_version, required_groups
from keras_gradtrack.io.schema import (
    AXIS_ATTR,
    EPOCH,
    INDEX_COLUMNS,
    LAYERS_GROUP,
    NUM_FEATURES_ATTR,
    OUTPUT_GRAD_NORM,
    OUTPUT_GRADIENTS_GROUP,
    OUTPUT_GRADIENTS_SCHEMA_VERSION,
    OUTPUT_GRADIENTS_SCHEMA_VERSION_ATTR,
    PER_STEP_GROUP,
    STATISTIC_DTYPE,
    STEP,
    layer_names_of,
    table_column,
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
            table_column(PER_STEP_GROUP, STEP, INDEX_COLUMNS[PER_STEP_GROUP][STEP], None),
            table_column(PER_STEP_GROUP, EPOCH, INDEX_COLUMNS[PER_STEP_GROUP][EPOCH], None),
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

    def group_attrs(self) -> dict[str, dict[str, Any]]:
        """Attributes of groups other than `/layers`: none."""
        return {}

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
            layer_names_of(groups[LAYERS_GROUP]),
            int(file.attrs.get(NUM_FEATURES_ATTR, norms.shape[1])),
            int(file.attrs.get(AXIS_ATTR, -1)),
            variables,
            norms.chunks[1] if norms.chunks else norms.shape[1],
        )
