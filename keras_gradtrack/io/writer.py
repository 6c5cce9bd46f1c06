"""`LogWriter`: streams per-example and per-step statistics into a gradient log."""

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keras_gradtrack.io import schema
from keras_gradtrack.io.block_writer import BlockWriter
from keras_gradtrack.io.checks import non_negative_int


class LogWriter(BlockWriter):
    """Writes gradient statistics to an HDF5 file in the gradient-log schema (version 2).

    Steps are buffered in memory and written in blocks: when `flush_every` steps are
    buffered, or at the first step `flush_seconds` after the last block. Every
    dataset is created before the file switches to SWMR mode, so `GradientLog` (or
    `h5py.File(path, "r", swmr=True)`) can read the file while it is being written,
    and a writer killed at any moment leaves every flushed row readable that way.

    Args:
        path: path of the HDF5 file.
        layer_names: the L layer names, in the column order of per-layer statistics.
        per_example: statistic name -> `None` for one value per example, or L for one
            value per example and layer.
        per_step: statistic name -> `None` for one value per step, or L for one value
            per step and layer; may hold the reserved `"learning_rate"` (`None`).
        target_ids: the ids of the targets, when `per_example` holds the reserved
            `"target_influence"` (width `len(target_ids)`).
        sketch: how the sketches are made, when `per_example` holds the reserved
            `"gradient_sketch"` (width `sum(sketch.widths)`).
        attrs: root attributes: the strings `library_version`, `keras_version`,
            `tensorflow_version` and `model_name`; any others are stored as given.
            The writer adds `schema_version` and `created`.
        **options: `overwrite`, `append` (its layers and statistics must match, and
            the steps written continue after its last step), `flush_every`,
            `flush_seconds`, `compression` and `background`, as `BlockWriter` takes
            them.

    Example:

    ```python
    writer = LogWriter(
        "run.h5",
        layer_names=["dense", "dense_1"],
        per_example={"loss": None, "layer_grad_norm": 2},
        per_step={"batch_grad_norm": None},
        attrs={"library_version": "0.1.0", "keras_version": "3.3.3",
               "tensorflow_version": "2.16.1", "model_name": "mlp"},
    )
    with writer:
        writer.write_step(
            step=0,
            epoch=0,
            example_ids=np.arange(4),
            per_example={"loss": np.ones(4), "layer_grad_norm": np.ones((4, 2))},
            per_step={"batch_grad_norm": 0.5},
        )
    ```
    """

    layout: schema.Layout

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        layer_names: Sequence[str],
        per_example: Mapping[str, int | None],
        per_step: Mapping[str, int | None],
        attrs: Mapping[str, Any],
        target_ids: Sequence[int] = (),
        sketch: schema.SketchLayout | None = None,
        **options: Any,
    ):
        layout = schema.Layout.from_arguments(
            layer_names, per_example, per_step, target_ids, sketch
        )
        super().__init__(path, layout, attrs=attrs, **options)

    def write_step(
        self,
        *,
        step: int,
        epoch: int,
        example_ids: Any,
        per_example: Mapping[str, Any],
        per_step: Mapping[str, Any],
        checked: bool = True,
    ) -> None:
        """Buffers one training step; writes a block every `flush_every` steps.

        Args:
            step: the step, counted from 0 at the start of this writer's run; the
                file numbers it on from its last step (`step_offset + step`).
                Each step must come after the previous one.
            epoch: epoch index, a non-negative integer.
            example_ids: integer ids of the B examples of the step, shape (B,); they
                are stored as int64, exactly (uint64 ids from 2**63 up are refused).
            per_example: every declared per-example column, shape (B,), (B, L), or
                (B, width) for the reserved attribution columns.
            per_step: every declared per-step column, a scalar or shape (L,).
            checked: False leaves every check of the step (and the copy of its
                arrays) to when its block is written, as `BlockWriter.write_rows`
                says: for rows made to the layout by the caller's own code, arrays
                left unchanged; the first step after `open()` is checked at once.

        NaN and infinite values are stored as they are.

        Raises:
            ValueError: if a name, shape or type differs from what was declared.
        """
        self._require_open()
        checked = self._checks_now(checked)
        if checked:
            epoch = non_negative_int("epoch", epoch)
            example_ids = np.asarray(example_ids)
            self._check_step_arguments(example_ids, per_example, per_step)
        batch_size = len(example_ids)
        rows = {
            schema.PER_EXAMPLE_GROUP: {
                schema.EPOCH: np.full(batch_size, epoch),
                schema.EXAMPLE_ID: example_ids,
                **per_example,
            },
            schema.PER_STEP_GROUP: {schema.EPOCH: epoch, schema.BATCH_SIZE: batch_size, **per_step},
        }
        self.write_rows(step, rows, checked=checked)

    def _check_step_arguments(
        self, example_ids: np.ndarray, per_example: Mapping[str, Any], per_step: Mapping[str, Any]
    ) -> None:
        """Raises ValueError unless the ids are 1-D integers and both tables hold
        exactly the declared columns."""
        if example_ids.ndim != 1 or (example_ids.size and example_ids.dtype.kind not in "iu"):
            raise ValueError(
                "Expected example_ids to be a 1-D array of integers. Received: "
                f"shape={example_ids.shape}, dtype={example_ids.dtype}"
            )
        for table, values in (
            (schema.PER_EXAMPLE_GROUP, per_example),
            (schema.PER_STEP_GROUP, per_step),
        ):
            declared = self.layout.widths(table)
            if set(values) != set(declared):
                raise ValueError(
                    f"Expected {table} to hold exactly the declared columns {sorted(declared)}. "
                    f"Received: {sorted(values)}"
                )
