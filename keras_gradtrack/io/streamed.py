"""`StreamedStep`: the large columns of one step, written part by part as they are computed."""

from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from keras_gradtrack.io.files import io_error


class StreamedStep:
    """The step `BlockWriter.streamed_step` is writing: its parts, then its other columns.

    Args:
        path: the log's path (for errors).
        row: the row the step fills.
        streamed: path -> dataset of the streamed columns, each already holding `row`.
    """

    def __init__(self, path: str, row: int, streamed: Mapping[str, h5py.Dataset]):
        self._path = path
        self._row = row
        self._streamed = streamed
        self.rows: Mapping[str, Mapping[str, Any]] | None = None

    def write_part(self, path: str, index: Any, values: Any) -> None:
        """Writes `values` to `dataset[row][index]` of the streamed column at `path`.

        Raises:
            ValueError: if `path` is not a streamed column of the layout.
            OSError: if the part cannot be written (a full disk, say).
        """
        if path not in self._streamed:
            raise ValueError(
                f"Expected the path of a streamed column, one of {sorted(self._streamed)}. "
                f"Received: {path=}"
            )
        dataset = self._streamed[path]
        index = index if isinstance(index, tuple) else (index,)
        try:
            dataset[(self._row, *index)] = np.asarray(values, dtype=dataset.dtype)
        except (OSError, RuntimeError) as error:
            raise io_error(
                "Cannot write the gradient log",
                self._path,
                error,
                "The file keeps every block written before this one.",
            ) from error

    def set_rows(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """The step's other columns, as for `BlockWriter.write_rows`."""
        self.rows = rows
