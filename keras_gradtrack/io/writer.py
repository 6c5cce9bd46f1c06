"""`LogWriter`: streams per-example and per-step statistics into an HDF5 log."""

import contextlib
import errno
import operator
import os
import re
import secrets
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import h5py
import numpy as np

from keras_gradtrack.io import schema

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

# h5py objects of logs that could not be closed after a write error: never freed,
# as freeing them crashes HDF5 (see `_close_without_writing`).
_UNCLOSABLE: list[tuple[h5py.File, object]] = []


class LogWriter:
    """Writes gradient statistics to an HDF5 file in the keras_gradtrack schema.

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
            per step and layer.
        attrs: root attributes: the strings `library_version`, `keras_version`,
            `tensorflow_version` and `model_name`; any others are stored as given.
            The writer adds `schema_version` and `created`.
        overwrite: replace the file if it exists.
        append: continue the log if the file exists; its layers and statistics must
            match. A missing file is created.
        flush_every: most steps written per block.
        flush_seconds: a block is also written at the first step this many seconds
            after the previous one (or after opening), so a reader sees rows at
            least that often while steps arrive; `None` writes blocks of exactly
            `flush_every` steps.
        compression: `"gzip"` (level 4), `"lzf"` or `None`.

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
            step=writer.next_step,
            epoch=0,
            example_ids=np.arange(4),
            per_example={"loss": np.ones(4), "layer_grad_norm": np.ones((4, 2))},
            per_step={"batch_grad_norm": 0.5},
        )
    ```
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        layer_names: Sequence[str],
        per_example: Mapping[str, int | None],
        per_step: Mapping[str, int | None],
        attrs: Mapping[str, Any],
        overwrite: bool = False,
        append: bool = False,
        flush_every: int = 100,
        flush_seconds: float | None = 1.0,
        compression: str | None = "gzip",
    ):
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(
                f"Expected flush_every to be a positive integer. Received: {flush_every=}"
            )
        check_flush_seconds(flush_seconds)
        if compression not in schema.COMPRESSIONS:
            raise ValueError(
                f"Expected compression in {list(schema.COMPRESSIONS)}. Received: {compression=}"
            )
        self.path = os.fspath(path)
        self.layout = schema.Layout.from_arguments(layer_names, per_example, per_step)
        self.attrs = schema.checked_caller_attrs(attrs)
        self.overwrite = overwrite
        self.append = append
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.compression = compression
        self._last_block = time.monotonic()
        self._file: h5py.File | None = None
        self._datasets: dict[str, dict[str, h5py.Dataset]] = {}
        self._next_step = 0
        self._pending_steps = 0
        self._pending = self._empty_buffer()

    @staticmethod
    def check_path(path: str | os.PathLike[str], *, overwrite: bool, append: bool) -> None:
        """Raises if a log cannot be written at `path` with these flags; writes nothing.

        Args:
            path: path of the HDF5 file.
            overwrite: whether an existing file may be replaced.
            append: whether an existing file may be continued.

        Raises:
            ValueError: if both `overwrite` and `append` are set.
            IsADirectoryError: if `path` is a directory.
            FileNotFoundError: if the parent directory does not exist.
            NotADirectoryError: if the parent path is not a directory.
            FileExistsError: if `path` exists and neither flag is set.
            PermissionError: if the file, or the directory a new file goes to, is not
                writable.

        Example:

        ```python
        LogWriter.check_path("run.h5", overwrite=False, append=False)
        ```
        """
        path = os.fspath(path)
        if overwrite and append:
            raise ValueError(
                "Pass at most one of overwrite=True (replace the file) and append=True "
                f"(continue it). Received: {overwrite=}, {append=}"
            )
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"Expected the path of a log file. Received a directory: '{path}'"
            )
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.exists(directory):
            raise FileNotFoundError(f"The directory of the log does not exist: '{directory}'")
        if not os.path.isdir(directory):
            raise NotADirectoryError(
                f"The parent of the log path is not a directory: '{directory}'"
            )
        if os.path.exists(path):
            if not (overwrite or append):
                raise FileExistsError(
                    f"The log file '{path}' already exists. To replace it pass overwrite=True; "
                    "to continue it pass append=True."
                )
            _check_writable_file(path)
        if overwrite or not os.path.exists(path):
            # A new log, replacing one or not, is made beside `path` and moved there.
            _check_writable_directory(directory)

    def open(self) -> None:
        """Creates (or, with `append=True`, opens) the file and switches it to SWMR mode.

        Raises:
            ValueError: when appending to a file that is not a keras_gradtrack log of
                schema version 1 with the same layers and statistics.
            OSError: when another process holds the file open.
            RuntimeError: if the writer is already open.
            (and the errors of `check_path`)
        """
        if self._file is not None:
            raise RuntimeError(f"The LogWriter for '{self.path}' is already open.")
        self.check_path(self.path, overwrite=self.overwrite, append=self.append)
        if self.append and os.path.exists(self.path):
            file = self._open_existing()
        else:
            file = self._create()
        self._file = file
        self._last_block = time.monotonic()
        # Looking datasets up by name costs more than writing a small block.
        self._datasets = {
            table: {name: file[table][name] for name in columns}
            for table, columns in self._pending.items()
        }

    @property
    def next_step(self) -> int:
        """The last step written + 1; 0 for a new file."""
        self._require_open()
        return self._next_step

    def write_step(
        self,
        *,
        step: int,
        epoch: int,
        example_ids: np.ndarray,
        per_example: Mapping[str, np.ndarray],
        per_step: Mapping[str, np.ndarray | float],
    ) -> None:
        """Buffers one training step; writes a block every `flush_every` steps.

        Args:
            step: global step, a non-negative integer.
            epoch: epoch index, a non-negative integer.
            example_ids: integer ids of the B examples of the step, shape (B,).
            per_example: every declared per-example statistic, shape (B,) or (B, L).
            per_step: every declared per-step statistic, a scalar or shape (L,).

        NaN and infinite values are stored as they are.

        Raises:
            ValueError: if a name, shape or type differs from what was declared.
        """
        self._require_open()
        step = _non_negative_int("step", step)
        epoch = _non_negative_int("epoch", epoch)
        example_ids = np.asarray(example_ids)
        if example_ids.ndim != 1 or (example_ids.size and example_ids.dtype.kind not in "iu"):
            raise ValueError(
                "Expected example_ids to be a 1-D array of integers. Received: "
                f"shape={example_ids.shape}, dtype={example_ids.dtype}"
            )
        batch_size = len(example_ids)
        example_rows = self.layout.checked_values(
            schema.PER_EXAMPLE_GROUP, per_example, (batch_size,)
        )
        step_row = self.layout.checked_values(schema.PER_STEP_GROUP, per_step, ())

        example_columns = {
            "step": np.full(batch_size, step),
            "epoch": np.full(batch_size, epoch),
            "example_id": example_ids.astype(np.int64),  # a copy: callers may reuse theirs
            **example_rows,
        }
        step_columns = {"step": step, "epoch": epoch, "batch_size": batch_size, **step_row}
        for name, values in example_columns.items():
            self._pending[schema.PER_EXAMPLE_GROUP][name].append(values)
        for name, value in step_columns.items():
            self._pending[schema.PER_STEP_GROUP][name].append(np.asarray(value)[np.newaxis])

        self._next_step = step + 1
        self._pending_steps += 1
        overdue = (
            self.flush_seconds is not None
            and time.monotonic() - self._last_block >= self.flush_seconds
        )
        if self._pending_steps >= self.flush_every or overdue:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered steps as one block and flushes the file to disk.

        Raises:
            OSError: if the block cannot be written (a full disk, say). The file then
                keeps the rows of every block written before; the block stays buffered,
                so a later `flush()` may retry it.
        """
        file = self._require_open()
        if not self._pending_steps:
            return
        # Every dataset of a table starts at the same row, so a block that failed
        # half-way is overwritten, not duplicated, by the next attempt.
        starts = {
            table: min(dataset.shape[0] for dataset in datasets.values())
            for table, datasets in self._datasets.items()
        }
        try:
            for table, columns in self._pending.items():
                for name, parts in columns.items():
                    dataset = self._datasets[table][name]
                    block = np.concatenate(parts).astype(dataset.dtype, copy=False)
                    if len(block):
                        dataset.resize(starts[table] + len(block), axis=0)
                        dataset[starts[table] :] = block
            file.flush()
        except (OSError, RuntimeError) as error:
            self._roll_back(starts)
            raise _io_error(
                "Cannot write the gradient log",
                self.path,
                error,
                "The file keeps every block written before this one.",
            ) from error
        self._pending = self._empty_buffer()
        self._pending_steps = 0
        self._last_block = time.monotonic()

    def _roll_back(self, lengths: Mapping[str, int]) -> None:
        # HDF5 writes the new lengths even when the rows' data could not be written;
        # readers would see the block as rows of fill values. Cut them off again.
        with contextlib.suppress(OSError, RuntimeError):
            for table, datasets in self._datasets.items():
                for dataset in datasets.values():
                    dataset.resize(lengths[table], axis=0)
            self._require_open().flush()

    def close(self) -> None:
        """Flushes and closes the file. Calling it again does nothing.

        Raises:
            OSError: if the buffered steps cannot be written; the file is closed anyway
                and keeps every block written before.
        """
        if self._file is None:
            return
        file = self._file
        try:
            self.flush()
        except OSError:
            _close_without_writing(file, self._datasets)
            raise
        except BaseException:
            file.close()
            raise
        else:
            file.close()
        finally:
            self._file, self._datasets = None, {}

    def __enter__(self) -> "LogWriter":
        if self._file is None:
            self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._file is not None else "closed"
        return (
            f"<LogWriter '{self.path}' ({state}): {len(self.layout.layer_names)} layers, "
            f"per_example={list(self.layout.per_example)}, per_step={list(self.layout.per_step)}>"
        )

    def _require_open(self) -> h5py.File:
        if self._file is None:
            raise RuntimeError(f"The LogWriter for '{self.path}' is not open. Call open() first.")
        return self._file

    def _empty_buffer(self) -> dict[str, dict[str, list[np.ndarray]]]:
        return {
            table: {name: [] for name in (*schema.INDEX_COLUMNS[table], *self.layout.widths(table))}
            for table in schema.TABLES
        }

    def _create(self) -> h5py.File:
        # Until it is in SWMR mode, a file killed half-made opens neither with nor
        # without swmr=True; so it is made under a hidden name and moved into place
        # only then. `path` is thus always absent, the old file, or a readable log.
        directory, name = os.path.split(os.path.abspath(self.path))
        staging = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            file = _open_h5py_file(staging, "x")
            try:
                schema.create_log(file, self.layout, self.attrs, self.compression)
                # SWMR readers need every dataset to exist before the switch.
                file.swmr_mode = True
                _move_into_place(staging, self.path, replace=self.overwrite)
            except BaseException:
                # The staging file is removed: nothing HDF5 still holds needs writing.
                _close_without_writing(file, {})
                raise
        except BaseException as error:
            with contextlib.suppress(FileNotFoundError):
                os.remove(staging)
            if isinstance(error, OSError | RuntimeError) and not isinstance(error, FileExistsError):
                raise _io_error(
                    "Cannot create the gradient log", self.path, error, "No file was written."
                ) from error
            raise
        self._next_step = 0
        return file

    def _open_existing(self) -> h5py.File:
        if not h5py.is_hdf5(self.path):
            raise ValueError(
                f"Cannot append to '{self.path}': it is not a keras_gradtrack log (not an HDF5 file)."
            )
        # Checked read-only first, so a file that is not a matching log is left as it is.
        with _open_h5py_file(self.path, "r") as file:
            found = schema.read_layout(file, self.path)
        _check_same_layout(self.path, found=found, given=self.layout)
        # Opened in SWMR mode at once: a file opened for writing without it, if killed
        # before the switch, opens neither with nor without swmr=True.
        file = _open_h5py_file(self.path, "r+", swmr=True)
        try:
            num_steps = _drop_incomplete_rows(file)
            steps = file[schema.PER_STEP_GROUP]["step"]
            self._next_step = int(steps[num_steps - 1]) + 1 if num_steps else 0
        except BaseException:
            file.close()
            raise
        return file


def _non_negative_int(argument: str, value: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if number < 0:
        raise ValueError(
            f"Expected {argument} to be a non-negative integer. Received: {argument}={value!r}"
        )
    return number


def _check_same_layout(path: str, *, found: schema.Layout, given: schema.Layout) -> None:
    for argument, in_file, received in (
        ("layer_names", found.layer_names, given.layer_names),
        ("per_example", found.per_example, given.per_example),
        ("per_step", found.per_step, given.per_step),
    ):
        if in_file != received:
            raise ValueError(
                f"Cannot append to '{path}': its {argument} differ. "
                f"Expected (in the file): {in_file}. Received: {argument}={received}"
            )


def _drop_incomplete_rows(file: h5py.File) -> int:
    """Cuts both tables back to the last step complete in both; returns its row count.

    A writer killed in the middle of a block can leave some datasets longer than
    others; appending after them would misalign the columns.
    """
    per_example = file[schema.PER_EXAMPLE_GROUP]
    per_step = file[schema.PER_STEP_GROUP]
    num_steps = schema.table_length(per_step)
    rows_through_step = np.cumsum(per_step["batch_size"][:num_steps], dtype=np.int64)
    num_steps = int(
        np.searchsorted(rows_through_step, schema.table_length(per_example), side="right")
    )
    num_examples = int(rows_through_step[num_steps - 1]) if num_steps else 0
    for group, length in ((per_example, num_examples), (per_step, num_steps)):
        for dataset in group.values():
            if dataset.shape[0] != length:
                dataset.resize(length, axis=0)
    return num_steps


def _move_into_place(staging: str, path: str, *, replace: bool) -> None:
    if replace:
        os.replace(staging, path)
        return
    try:
        # A hard link, unlike a rename, fails if `path` appeared since check_path.
        os.link(staging, path)
    except FileExistsError as error:
        raise FileExistsError(
            f"The log file '{path}' already exists. To replace it pass overwrite=True; "
            "to continue it pass append=True."
        ) from error
    except OSError:
        # Some file systems have no hard links; check_path saw no file a moment ago.
        os.rename(staging, path)
        return
    os.remove(staging)


def _close_without_writing(file: h5py.File, datasets: object) -> None:
    """Closes `file`, discarding what HDF5 still holds to write; leaves the file as is.

    After a failed write (a full disk, say) HDF5 keeps the chunks it could not write
    and retries them when closing, which fails again: the datasets stay open and
    print errors when garbage-collected. The file on disk already holds every block
    before the failed one (`flush` rolled that back), so HDF5's last writes go to a
    file in memory instead. The log stays marked as open for writing, like that of a
    killed writer: readers open it with swmr=True.
    """
    if hasattr(os, "memfd_create"):  # Linux: an anonymous file in memory
        discard = os.memfd_create("keras_gradtrack-discarded")
    else:
        discard = os.open(os.devnull, os.O_RDWR)
    # A file size limit (ulimit -f) would refuse the memory file too: lift it meanwhile.
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE) if resource else None
    try:
        if size_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (size_limit[1], size_limit[1]))
        os.dup2(discard, file.id.get_vfd_handle())
        file.close()
    except (OSError, RuntimeError, ValueError):
        # HDF5 objects left half-closed crash the process when garbage-collected.
        _UNCLOSABLE.append((file, datasets))
    finally:
        if size_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, size_limit)
        os.close(discard)


def _io_error(failed: str, path: str, error: BaseException, outcome: str) -> OSError:
    """An OSError naming the log and the system's reason, from an h5py error."""
    # h5py raises RuntimeError or OSError with HDF5's message, which holds the errno.
    found = re.search(r"errno = (\d+)", str(error))
    code = int(found.group(1)) if found else getattr(error, "errno", None)
    reason = os.strerror(code) if code else str(error)
    message = f"{failed} '{path}': {reason}. {outcome}"
    return OSError(code, message) if code else OSError(message)


def _open_h5py_file(path: str, mode: str, *, swmr: bool = False) -> h5py.File:
    try:
        if swmr:
            # h5py only opens files for reading in SWMR mode; the low-level call can write.
            access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
            bounds = {"v110": h5py.h5f.LIBVER_V110, "latest": h5py.h5f.LIBVER_LATEST}
            access.set_libver_bounds(*(bounds[bound] for bound in schema.LIBVER))
            flags = h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE
            return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=access))
        return h5py.File(path, mode, libver=schema.LIBVER)
    except OSError as error:
        if "lock" not in str(error) and "already open" not in str(error):
            raise
        raise OSError(
            f"Cannot open '{path}' for writing: {error}. Another process may hold it open "
            "(close any GradientLog or h5py.File reading it). If a previous writer was "
            "killed, HDF5 still marks the file as open for writing; HDF5's `h5clear -s` "
            "tool removes that mark."
        ) from error


def _check_writable_file(path: str) -> None:
    message = f"The log file '{path}' is not writable."
    if not os.access(path, os.W_OK):
        raise PermissionError(message)
    try:
        with open(path, "r+b"):
            pass
    except PermissionError as error:
        raise PermissionError(message) from error


def _check_writable_directory(directory: str) -> None:
    # os.access alone is not enough: root passes it everywhere, and read-only or
    # special file systems only refuse when a file is really created.
    message = f"Cannot create the log file: the directory '{directory}' is not writable."
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(message)
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".keras_gradtrack-", dir=directory)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise PermissionError(message) from error
        # Not the probe's name (the user never asked for it): the directory and why.
        raise OSError(
            error.errno, f"Cannot create the log file in '{directory}': {error.strerror}"
        ) from error
    os.close(descriptor)
    os.remove(probe)


def check_flush_seconds(flush_seconds: Any) -> None:
    """Raises ValueError unless `flush_seconds` is None or a non-negative number."""
    number = isinstance(flush_seconds, (int, float)) and not isinstance(flush_seconds, bool)
    if flush_seconds is not None and not (number and flush_seconds >= 0):
        raise ValueError(
            "Expected flush_seconds to be a non-negative number or None. "
            f"Received: {flush_seconds=}"
        )
