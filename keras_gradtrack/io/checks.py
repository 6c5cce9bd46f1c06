"""Checks of what a writer is given: steps, rows of a step, the layout of a file."""

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_gradtrack.io.hdf5_tables import Column


def non_negative_int(argument: str, value: Any) -> int:
    """`value` as an int; raises ValueError unless it is a non-negative integer."""
    try:
        number = operator.index(np.asarray(value).item() if np.ndim(value) == 0 else value)
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < 0:
        raise ValueError(
            f"Expected {argument} to be a non-negative integer. Received: {argument}={value!r}"
        )
    return number


def checked_step(step: Any, last_step: int | None) -> int:
    """`step` as an int; raises ValueError unless it is a non-negative integer after
    `last_step` (the step before it, if any)."""
    step = non_negative_int("step", step)
    if last_step is not None and step <= last_step:
        raise ValueError(
            f"Expected each step to come after the previous one ({last_step}). "
            f"Received: step={step}"
        )
    return step


def check_flush_seconds(flush_seconds: Any) -> None:
    """Raises ValueError unless `flush_seconds` is None or a non-negative number."""
    number = isinstance(flush_seconds, (int, float)) and not isinstance(flush_seconds, bool)
    if flush_seconds is not None and not (number and flush_seconds >= 0):
        raise ValueError(
            "Expected flush_seconds to be a non-negative number or None. "
            f"Received: {flush_seconds=}"
        )


def checked_rows(table: str, column: Column, values: Any, num_rows: int | None) -> np.ndarray:
    """One column's rows of a step, as a copy in the column's dtype, or a ValueError."""
    array = np.asarray(values)
    expected = column.row_shape if num_rows is None else (num_rows, *column.row_shape)
    if array.shape != expected:
        raise ValueError(
            f"Expected {table}['{column.name}'] to have shape {expected}. "
            f"Received: shape={array.shape}"
        )
    if array.dtype == column.dtype:
        converted = array.copy()  # the caller may change its array after the step
    elif column.dtype.kind == "f":
        # Values beyond float32's range are stored as inf, like NaN as NaN: no warning.
        with np.errstate(over="ignore", invalid="ignore"):
            converted = array.astype(column.dtype)
    else:
        converted = array.astype(column.dtype)
        if array.size and (array.dtype.kind not in "iub" or (converted != array).any()):
            raise ValueError(
                f"Expected {table}['{column.name}'] to hold integers that fit "
                f"{column.dtype}. Received: dtype={array.dtype}, values from "
                f"{array.min()} to {array.max()}"
            )
    return converted.reshape(1, *column.row_shape) if num_rows is None else converted


def check_same_layout(path: str, *, found: Any, given: Any) -> None:
    """Raises ValueError naming the first field (compared ones only) where the layouts differ."""
    for field in dataclasses.fields(given):
        in_file, received = getattr(found, field.name), getattr(given, field.name)
        if field.compare and in_file != received:
            raise ValueError(
                f"Cannot append to '{path}': its {field.name} differ. "
                f"Expected (in the file): {in_file}. Received: {field.name}={received}"
            )


def check_layer_names(layer_names: Sequence[str]) -> None:
    """Raises ValueError unless `layer_names` is a sequence of unique strings."""
    if isinstance(layer_names, str) or not all(isinstance(n, str) for n in layer_names):
        raise ValueError(
            f"Expected layer_names to be a sequence of strings. Received: {layer_names=}"
        )
    if len(set(layer_names)) != len(layer_names):
        raise ValueError(f"Expected unique layer names. Received: {layer_names=}")
