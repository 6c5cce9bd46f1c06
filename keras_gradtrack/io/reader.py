"""`GradientLog`: reads a keras_gradtrack log, also while it is being written."""

import os
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from keras_gradtrack.io import schema

if TYPE_CHECKING:
    import pandas

    from keras_gradtrack import analysis


class GradientLog:
    """Read access to a keras_gradtrack HDF5 log.

    The file is opened read-only in SWMR mode when possible, so a log can be read
    while `HDF5GradientLogger` is still writing it; `refresh()` picks up the rows
    written since. Every read of a table returns the rows present in all of its
    datasets, so columns read together always have equal lengths.

    Args:
        path: path of the log file.

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: if the file is not a keras_gradtrack log, or was written with an
            unsupported schema version.

    Example:

    ```python
    with GradientLog("run.h5") as log:
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
    def layers(self) -> list[str]:
        """The L layer names: the column order of per-layer statistics."""
        return list(self._layout.layer_names)

    @property
    def attrs(self) -> dict[str, Any]:
        """The root attributes: `schema_version`, `library_version`, `created`, ..."""
        file = self._require_open()
        return {name: _to_python(value) for name, value in file.attrs.items()}

    @property
    def per_example_names(self) -> list[str]:
        """Names of the per-example statistics, in the order they were declared."""
        return list(self._layout.per_example)

    @property
    def per_step_names(self) -> list[str]:
        """Names of the per-step statistics, in the order they were declared."""
        return list(self._layout.per_step)

    @property
    def num_examples(self) -> int:
        """Number of complete per-example rows."""
        return schema.table_length(self._require_open()[schema.PER_EXAMPLE_GROUP])

    @property
    def num_steps(self) -> int:
        """Number of complete per-step rows."""
        return schema.table_length(self._require_open()[schema.PER_STEP_GROUP])

    def per_example(self, name: str) -> np.ndarray:
        """One per-example column: a statistic, `"step"`, `"epoch"` or `"example_id"`.

        Args:
            name: column name.

        Returns:
            Array of shape (N,) or, for a per-layer statistic, (N, L).

        Raises:
            KeyError: for an unknown name; the message lists the available ones.
        """
        return self._read(schema.PER_EXAMPLE_GROUP, name)

    def per_step(self, name: str) -> np.ndarray:
        """One per-step column: a statistic, `"step"`, `"epoch"` or `"batch_size"`.

        Args:
            name: column name.

        Returns:
            Array of shape (S,) or, for a per-layer statistic, (S, L).

        Raises:
            KeyError: for an unknown name; the message lists the available ones.
        """
        return self._read(schema.PER_STEP_GROUP, name)

    def refresh(self) -> None:
        """Makes the rows written since opening (or the last refresh) visible."""
        file = self._require_open()
        if file.swmr_mode:
            for table in schema.TABLES:
                for dataset in file[table].values():
                    dataset.refresh()
        else:
            file.close()
            self._file = None
            self._open()

    def to_pandas(self, kind: str = "per_example") -> "pandas.DataFrame":
        """One table as a `pandas.DataFrame`.

        Per-layer statistics become one column per layer, named `"<stat>/<layer>"`.

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
                "GradientLog.to_pandas() needs pandas. "
                "Install it with `pip install keras-gradtrack[pandas]`."
            ) from error
        group = self._require_open()[kind]
        length = schema.table_length(group)
        columns: dict[str, np.ndarray] = {}
        for name, dataset in group.items():
            values = dataset[:length]
            if values.ndim == 1:
                columns[name] = values
            else:
                for layer, column in zip(self._layout.layer_names, values.T, strict=True):
                    columns[f"{name}/{layer}"] = column
        return pandas.DataFrame(columns)

    # -- analysis: thin delegations to keras_gradtrack.analysis --------------

    def summary(self) -> str:
        """A plain-text summary: steps, examples, layers, range of every statistic.

        Example:

        ```python
        print(GradientLog("run.h5").summary())
        ```
        """
        from keras_gradtrack import analysis

        return analysis.summary(self)

    def example_history(self, example_id: int) -> dict[str, np.ndarray]:
        """Every logged row of one example, in step order (`analysis.example_history`).

        Example:

        ```python
        log.example_history(17)["cosine"]
        ```
        """
        from keras_gradtrack import analysis

        return analysis.example_history(self, example_id)

    def self_influence(self, learning_rate: float | None = None) -> "analysis.ExampleScores":
        """TracIn self-influence per example: `sum_t lr_t ||g_i,t||^2` (`analysis.self_influence`).

        Example:

        ```python
        scores = log.self_influence()  # ExampleScores, ordered by example id
        ```
        """
        from keras_gradtrack import analysis

        return analysis.self_influence(self, learning_rate)

    def most_influential(
        self, k: int = 10, learning_rate: float | None = None
    ) -> "analysis.ExampleScores":
        """The `k` examples of highest self-influence, highest first: the suspicious ones.

        Example:

        ```python
        log.most_influential(20).example_id
        ```
        """
        from keras_gradtrack import analysis

        return analysis.most_influential(self, k, learning_rate)

    def negative_cosine_frequency(self) -> "analysis.ExampleScores":
        """Per example, the fraction of its logged steps with `cosine < 0`.

        Example:

        ```python
        log.negative_cosine_frequency().score  # ordered by example id
        ```
        """
        from keras_gradtrack import analysis

        return analysis.negative_cosine_frequency(self)

    def most_opposing(self, k: int = 10) -> "analysis.ExampleScores":
        """The `k` examples most often with `cosine < 0` (`analysis.most_opposing`).

        Example:

        ```python
        log.most_opposing(10).score  # fraction of their steps against the batch
        ```
        """
        from keras_gradtrack import analysis

        return analysis.most_opposing(self, k)

    def layer_summary(
        self, statistic: str = "layer_grad_norm", by: str = "step", reduce: str = "median"
    ) -> "analysis.LayerSummary":
        """A per-layer statistic reduced per step or epoch (`analysis.layer_summary`).

        Example:

        ```python
        log.layer_summary("layer_cosine", by="epoch").values  # (epochs, L)
        ```
        """
        from keras_gradtrack import analysis

        return analysis.layer_summary(self, statistic, by, reduce)

    def to_csv(self, path: str | os.PathLike[str], kind: str = "per_example") -> str:
        """Writes one table to CSV; returns the path (`analysis.to_csv`).

        Example:

        ```python
        log.to_csv("run.per_step.csv", kind="per_step")
        ```
        """
        from keras_gradtrack import analysis

        return analysis.to_csv(self, path, kind)

    def to_parquet(self, path: str | os.PathLike[str], kind: str = "per_example") -> str:
        """Writes one table to Parquet (needs pyarrow); returns the path (`analysis.to_parquet`).

        Example:

        ```python
        log.to_parquet("run.per_example.parquet")
        ```
        """
        from keras_gradtrack import analysis

        return analysis.to_parquet(self, path, kind)

    def close(self) -> None:
        """Closes the file. Calling it again does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "GradientLog":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._file is None:
            return f"<GradientLog '{self.path}' (closed)>"
        return (
            f"<GradientLog '{self.path}': {self.num_examples} example rows, "
            f"{self.num_steps} step rows, layers={self.layers}, "
            f"per_example={self.per_example_names}, per_step={self.per_step_names}>"
        )

    def _open(self) -> None:
        try:
            # SWMR lets the file be read while a writer is appending to it, and opens
            # files whose writer was killed (plain opens refuse those).
            file = h5py.File(self.path, "r", swmr=True)
        except OSError:
            file = h5py.File(self.path, "r")
        try:
            self._layout = schema.read_layout(file, self.path)
        except BaseException:
            file.close()
            raise
        self._file = file

    def _require_open(self) -> h5py.File:
        if self._file is None:
            raise ValueError(f"The GradientLog for '{self.path}' is closed.")
        return self._file

    def _read(self, table: str, name: str) -> np.ndarray:
        group = self._require_open()[table]
        if name not in group:
            raise KeyError(f"No {table} column {name!r} in '{self.path}'. Available: {list(group)}")
        return group[name][: schema.table_length(group)]


def _to_python(value: Any) -> Any:
    """Turns numpy scalars and arrays read from HDF5 attributes into Python values."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return value
