"""Columns of a log: one example's history, per-layer and per-step summaries, export."""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from keras_gradtrack.io.reader import LogReader, table_columns
from keras_gradtrack.io.schema import LEARNING_RATE, PER_EXAMPLE_GROUP, PER_STEP_GROUP

CSV_BLOCK_ROWS = 65536
REDUCERS: dict[str, Callable[..., np.ndarray]] = {
    "median": np.nanmedian,
    "mean": np.nanmean,
    "min": np.nanmin,
    "max": np.nanmax,
}


@dataclasses.dataclass(frozen=True)
class LayerSummary:
    """A per-layer statistic reduced over examples, per step or per epoch.

    Attributes:
        statistic: the statistic's name, e.g. `"layer_grad_norm"`.
        by: `"step"` or `"epoch"`: what `index` holds.
        index: int64 array (T,): the steps or epochs.
        values: float64 array (T, L): the reduced values, columns `layers`.
        layers: the L layer names.
    """

    statistic: str
    by: str
    index: np.ndarray
    values: np.ndarray
    layers: list[str]


def per_example_learning_rate(log: LogReader) -> np.ndarray:
    """The learning rate of each per-example row, joined from `/per_step` by step.

    Returns:
        float64 array (N,); NaN for rows whose step has no per-step row yet (a
        block still being written).

    Raises:
        KeyError: if the log has no `/per_step/learning_rate`.

    Example:

    ```python
    weighted = log.per_example("grad_norm") ** 2 * per_example_learning_rate(log)
    ```
    """
    if LEARNING_RATE not in log.per_step_names:
        raise KeyError(
            f"'{log.path}' has no /per_step/{LEARNING_RATE} (HDF5GradientLogger writes "
            f"it). Available per-step columns: {log.per_step_names}"
        )
    steps = log.per_step("step")
    order = np.argsort(steps, kind="stable")
    sorted_steps = steps[order]
    sorted_rates = log.per_step(LEARNING_RATE).astype(np.float64)[order]
    row_steps = log.per_example("step")
    joined = np.full(row_steps.shape, np.nan)
    if len(steps):
        position = np.minimum(np.searchsorted(sorted_steps, row_steps), len(steps) - 1)
        found = sorted_steps[position] == row_steps
        joined[found] = sorted_rates[position[found]]
    return joined


def example_history(log: LogReader, example_id: int) -> dict[str, np.ndarray]:
    """Every logged row of one example, in step order.

    Args:
        log: the log.
        example_id: the example's id.

    Returns:
        Column name -> array: `step`, `epoch`, every per-example statistic ((n,) or
        (n, L)) and, when logged, `learning_rate`.

    Raises:
        KeyError: if the id does not appear in the log.

    Example:

    ```python
    history = log.example_history(17)
    history["step"], history["loss"], history["cosine"]
    ```
    """
    ids = log.per_example("example_id")
    rows = np.flatnonzero(ids == example_id)
    if rows.size == 0:
        known = f"ids {ids.min()}..{ids.max()}" if ids.size else "no rows"
        raise KeyError(f"example_id={example_id!r} is not in '{log.path}' (it holds {known}).")
    rows = rows[np.argsort(log.per_example("step")[rows], kind="stable")]
    history = {name: log.per_example(name)[rows] for name in ("step", "epoch")}
    for name in log.per_example_names:
        history[name] = log.per_example(name)[rows]
    if LEARNING_RATE in log.per_step_names:
        history[LEARNING_RATE] = per_example_learning_rate(log)[rows]
    return history


def layer_summary(
    log: LogReader, statistic: str = "layer_grad_norm", by: str = "step", reduce: str = "median"
) -> LayerSummary:
    """A per-layer statistic over time: its `reduce` over the rows of each step or epoch.

    Args:
        log: the log.
        statistic: a per-layer statistic, per example (`layer_grad_norm`,
            `layer_cosine`) or per step.
        by: `"step"` or `"epoch"`.
        reduce: `"median"`, `"mean"`, `"min"` or `"max"` (NaN ignored).

    Returns:
        A `LayerSummary`; a layer with no finite value in a group gives NaN there.

    Example:

    ```python
    summary = log.layer_summary("layer_cosine", by="epoch")
    dict(zip(summary.layers, summary.values[-1]))  # last epoch, per layer
    ```
    """
    if by not in ("step", "epoch"):
        raise ValueError(f"Expected by in ['step', 'epoch']. Received: by={by!r}")
    if reduce not in REDUCERS:
        raise ValueError(f"Expected reduce in {list(REDUCERS)}. Received: reduce={reduce!r}")
    per_layer = per_layer_statistics(log)
    if statistic not in per_layer:
        raise ValueError(
            f"Expected a per-layer statistic of '{log.path}', one of {per_layer}. "
            f"Received: statistic={statistic!r}"
        )
    read = log.per_example if statistic in log.per_example_names else log.per_step
    values = read(statistic).astype(np.float64)
    index, groups = grouped_rows(read(by))
    reduced = np.full((len(index), values.shape[1]), np.nan)
    with warnings.catch_warnings():
        # A layer without finite values in a group is NaN there, not a warning.
        warnings.simplefilter("ignore", RuntimeWarning)
        for position, rows in enumerate(groups):
            reduced[position] = REDUCERS[reduce](values[rows], axis=0)
    return LayerSummary(statistic, by, index.astype(np.int64), reduced, log.layers)


def step_quantiles(
    log: LogReader, statistic: str, quantiles: Iterable[float] = (0.1, 0.5, 0.9)
) -> tuple[np.ndarray, np.ndarray]:
    """Quantiles over the examples of each step of a per-example statistic (for bands).

    Returns:
        `(steps (S,), values (S, Q))`; NaN values are ignored.

    Example:

    ```python
    steps, bands = step_quantiles(log, "grad_norm")  # 10%, median, 90% per step
    ```
    """
    values = per_example_column(log, statistic).astype(np.float64)
    if values.ndim != 1:
        raise ValueError(
            f"Expected a per-example statistic with one value per row. "
            f"Received: {statistic!r} of shape {values.shape}"
        )
    levels = np.asarray(list(quantiles), dtype=np.float64)
    steps, groups = grouped_rows(log.per_example("step"))
    bands = np.full((len(steps), len(levels)), np.nan)
    for position, rows in enumerate(groups):
        if np.isfinite(values[rows]).any():
            bands[position] = np.nanquantile(values[rows], levels)
    return steps, bands


def to_csv(log: LogReader, path: str | os.PathLike[str], kind: str = "per_example") -> str:
    """Writes one table to a CSV file with a header row (NaN as `nan`). Returns the path.

    Floats are written with 7 significant digits (they are float32 in the log).

    Example:

    ```python
    log.to_csv("run.per_step.csv", kind="per_step")
    ```
    """
    columns = table_columns(log, kind)
    formats = ["%d" if values.dtype.kind in "iu" else "%.7g" for values in columns.values()]
    length = len(next(iter(columns.values())))
    with open(path, "w", newline="") as file:
        file.write(",".join(columns) + "\n")
        for start in range(0, length, CSV_BLOCK_ROWS):  # bounded memory for long logs
            block = [values[start : start + CSV_BLOCK_ROWS] for values in columns.values()]
            matrix = np.column_stack([values.astype(np.float64) for values in block])
            np.savetxt(file, matrix, fmt=formats, delimiter=",")
    return os.fspath(path)


def to_parquet(log: LogReader, path: str | os.PathLike[str], kind: str = "per_example") -> str:
    """Writes one table to a Parquet file, with the log's dtypes. Returns the path.

    Raises:
        ImportError: if pyarrow is not installed (`pip install keras-gradtrack[parquet]`).

    Example:

    ```python
    log.to_parquet("run.per_example.parquet")
    ```
    """
    pyarrow = import_optional("pyarrow", "to_parquet()", "parquet")
    parquet = import_optional("pyarrow.parquet", "to_parquet()", "parquet")
    parquet.write_table(pyarrow.table(table_columns(log, kind)), os.fspath(path))
    return os.fspath(path)


def grouped_rows(keys: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct `keys`, ascending, and for each the indices of its rows."""
    order = np.argsort(keys, kind="stable")
    distinct, starts = np.unique(keys[order], return_index=True)
    return distinct, np.split(order, starts[1:]) if len(order) else []


def per_layer_statistics(log: LogReader) -> list[str]:
    """Names of the statistics with one column per layer, per-example ones first."""
    # The layout gives the widths without reading the (possibly large) datasets.
    return [
        name
        for table in (PER_EXAMPLE_GROUP, PER_STEP_GROUP)
        for name in log.layout.per_layer(table)
    ]


def per_example_column(log: LogReader, name: str) -> np.ndarray:
    """A per-example statistic; a `KeyError` says which statistic an analysis needs."""
    if name not in log.per_example_names:
        raise KeyError(
            f"This needs the per-example statistic {name!r}, which '{log.path}' does not "
            f"hold. Available: {log.per_example_names}"
        )
    return log.per_example(name)


def import_optional(module: str, needed_by: str, extra: str) -> Any:
    """Imports an optional dependency, or raises an `ImportError` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        raise ImportError(
            f"{needed_by} needs {top}, which is not installed. Install it with "
            f"`pip install {top}` or `pip install keras-gradtrack[{extra}]`."
        ) from error
