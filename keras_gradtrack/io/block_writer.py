"""`BlockWriter`: streams the rows of a declared layout into an HDF5 file, in blocks.

Both logs (see `io.schema`) are written by this one core: a new file is made under
a hidden name with every dataset, switched to SWMR mode and only then moved into
place; steps are buffered and written in blocks; a block that fails is cut off
again; and only one writer per file is open in a process.
"""

import atexit
import contextlib
import errno
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import h5py

from keras_gradtrack.io import blocks, files, output_schema, schema
from keras_gradtrack.io.blocks import Block, BlockThread, Rows, append_block, record_of
from keras_gradtrack.io.checks import check_flush_seconds, checked_step
from keras_gradtrack.io.discard import close_without_writing
from keras_gradtrack.io.hdf5_tables import COMPRESSIONS, Table, rows_in_all
from keras_gradtrack.io.streamed import StreamedStep

# The writers of this process that have a file open, by real path: a second writer
# on the same file would interleave its rows with the first one's buffered block.
_OPEN_WRITERS: dict[str, "BlockWriter"] = {}


_Self = TypeVar("_Self", bound="BlockWriter")


class BlockWriter:
    """Writes the tables of `layout` to an HDF5 file, buffered in blocks of steps.

    Steps are numbered by the caller from 0 (the first step of its run); the file
    numbers them on from the last step already in it, so an appended log
    continues where it stopped. Steps must come in increasing order.

    A block is written when `flush_every` steps are buffered, or at the first step
    `flush_seconds` after the last block. Buffered steps are written however the
    writer ends: `close()`, a `with` block, or the normal exit of the process.

    With `background=True` a due block is written on a thread (`io.blocks`) while the
    caller goes on; the next block, `flush()` and `close()` wait for it. A block that
    fails there stays buffered; the next `write_rows`, `flush` or `close` raises its error.

    Args:
        path: path of the HDF5 file.
        layout: the file's layout: a `schema.Layout` or `output_schema.OutputGradientLayout`.
        attrs: root attributes: the strings `library_version`, `keras_version`,
            `tensorflow_version` and `model_name`; any others are stored as given.
        overwrite: replace the file if it exists.
        append: continue the log if the file exists; its layout must match. A
            missing file is created.
        flush_every: most steps written per block.
        flush_seconds: a block is also written at the first step this many seconds
            after the previous one (or after opening); `None` writes blocks of
            exactly `flush_every` steps.
        compression: `"gzip"` (level 4), `"lzf"` or `None`.
        background: write due blocks on a thread of their own (see above).

    Example:

    ```python
    layout = schema.Layout.from_arguments(["dense"], {"loss": None}, {})
    with BlockWriter("run.h5", layout, attrs=attrs) as writer:
        writer.write_rows(0, {"per_example": {"epoch": [0, 0], "example_id": [7, 9],
                                              "loss": [0.5, 0.25]},
                              "per_step": {"epoch": 0, "batch_size": 2}})
    ```
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: schema.Layout | output_schema.OutputGradientLayout,
        *,
        attrs: Mapping[str, Any],
        overwrite: bool = False,
        append: bool = False,
        flush_every: int = 100,
        flush_seconds: float | None = 1.0,
        compression: str | None = "gzip",
        background: bool = False,
    ):
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(
                f"Expected flush_every to be a positive integer. Received: {flush_every=}"
            )
        check_flush_seconds(flush_seconds)
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"Expected compression in {list(COMPRESSIONS)}. Received: {compression=}"
            )
        self.path = os.fspath(path)
        self.layout = layout
        self.attrs = schema.checked_caller_attrs(attrs)
        self.overwrite = overwrite
        self.append = append
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.compression = compression
        self.background = background
        self._tables: dict[str, Table] = layout.tables()
        # The table with one row per step: its step column numbers the file's steps.
        self._steps_table = next(t for t in self._tables.values() if t.rows_per_step is None)
        self._file: h5py.File | None = None
        self._datasets: dict[str, h5py.Dataset] = {}
        # Per buffered step its record (column path -> its rows), or the step unchecked.
        self._pending: Block = []
        self._step_offset = 0
        self._last_step: int | None = None
        self._written_step: int | None = None
        self._last_block = time.monotonic()
        self._background = BlockThread(f"keras_gradtrack writer of {self.path}")

    @staticmethod
    def check_path(path: str | os.PathLike[str], *, overwrite: bool, append: bool) -> None:
        """Raises if a log cannot be written at `path` with these flags; writes nothing.

        Args:
            path: path of the HDF5 file.
            overwrite: whether an existing file may be replaced.
            append: whether an existing file may be continued.

        Raises:
            OSError: (`errno.EBUSY`) if a writer of this process has the file open.
            ValueError, FileExistsError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError: as `io.files.check_path` says.

        Example:

        ```python
        LogWriter.check_path("run.h5", overwrite=False, append=False)
        ```
        """
        path = os.fspath(path)
        holder = _OPEN_WRITERS.get(os.path.realpath(path))
        if holder is not None and holder._process == os.getpid():
            raise OSError(
                errno.EBUSY,
                f"'{path}' is already open for writing in this process, by {holder!r}. "
                "Close that writer first (its close(); a logger whose fit stopped with an "
                "error still holds its last steps and writes them when closed), or pass "
                "the same logger to fit again: it continues its own file.",
            )
        files.check_path(path, overwrite=overwrite, append=append)

    def open(self) -> None:
        """Creates (or, with `append=True`, opens) the file and switches it to SWMR mode.

        Raises:
            ValueError: when appending to a file that is not a log of the same layout.
            OSError: when another writer holds the file open.
            RuntimeError: if the writer is already open.
            (and the errors of `check_path`)
        """
        if self._file is not None:
            raise RuntimeError(f"The writer for '{self.path}' is already open.")
        self.check_path(self.path, overwrite=self.overwrite, append=self.append)
        if self.append and os.path.exists(self.path):
            file, num_steps = files.open_to_append(self.path, self.layout, self._tables)
        else:
            header = schema.header(self.layout, self.attrs)
            file = files.create(self.path, header, self._tables, self.compression, self.overwrite)
            num_steps = 0
        steps = file[self._steps_table.step_column.path]
        self._step_offset = int(steps[num_steps - 1]) + 1 if num_steps else 0
        self._file = file
        # Looking datasets up by name costs more than writing a small block.
        self._datasets = {c.path: file[c.path] for t in self._tables.values() for c in t.columns}
        self._pending = []
        self._last_step = None
        self._written_step = None
        self._last_block = time.monotonic()
        # A forked child inherits the table, not the right to write its files.
        self._process = os.getpid()
        _OPEN_WRITERS[os.path.realpath(self.path)] = self

    @property
    def step_offset(self) -> int:
        """The file's number of the caller's step 0: the file's last step + 1 when opened."""
        self._require_open()
        return self._step_offset

    @property
    def last_step(self) -> int | None:
        """The file's number of the last step written or buffered since opening, if any."""
        self._require_open()
        return None if self._last_step is None else self._step_offset + self._last_step

    @property
    def last_written_step(self) -> int | None:
        """The file's number of the last step of the blocks written since opening, if any
        (a block being written in the background counts once it is in the file)."""
        self._require_open()
        return self._written_step

    def write_rows(self, step: int, rows: Rows, *, checked: bool = True) -> None:
        """Buffers one step; writes a block every `flush_every` steps.

        Args:
            step: the step, counted from 0 at the start of the caller's run.
            rows: table name -> column name -> values, for every column of the layout
                except `step` (the writer fills it) and the streamed ones. A table with
                one row per step takes the row itself (a scalar, or the row's shape);
                others take one row per count in their `rows_per_step` column.
            checked: False checks and copies the rows (arrays the caller leaves as
                they are) when their block is written, on the writer's thread with
                `background=True`; the first step after `open()` at once. A step that
                does not fit then fails its block, before any of it reaches the file.

        Raises:
            ValueError: if a name, shape or type differs from the layout, or `step`
                does not come after the previous one.
            OSError: if a block cannot be written (now or in the background): as `flush`.
        """
        self._require_open()
        step = checked_step(step, self._last_step)
        number = self._step_offset + step
        # One append: an interrupt leaves the buffer whole.
        self._pending.append(blocks.entry_of(self._tables, number, rows, self._checks_now(checked)))
        self._last_step = step
        if self._background.failed:
            self._wait_for_background()  # raises the block's error
        overdue = (
            self.flush_seconds is not None
            and time.monotonic() - self._last_block >= self.flush_seconds
        )
        if len(self._pending) < self.flush_every and not overdue:
            return
        if not self.background:
            return self.flush()
        self._wait_for_background()
        block, self._pending = self._pending, []
        self._last_block = time.monotonic()
        self._background.start(self._write_block, block)

    @contextlib.contextmanager
    def streamed_step(self, step: int) -> Iterator[StreamedStep]:
        """One step whose streamed columns are written in parts; the step is flushed at once.

        The row of every streamed column is allocated first and written part by part
        (`write_part`); the other columns are given with `set_rows` and the block is
        written when the `with` block ends. If it ends with an error, the allocated
        rows are cut off again and nothing of the step remains.

        Example:

        ```python
        with writer.streamed_step(0) as step:
            for features, values in chunks:
                step.write_part("output_gradients/dense/kernel", np.s_[features], values)
            step.set_rows({"per_step": {"epoch": 0, "output_grad_norm": norms}})
        ```
        """
        self._require_open()
        self._wait_for_background()
        step = checked_step(step, self._last_step)
        columns = [c for t in self._tables.values() for c in t.columns if c.streamed]
        row = rows_in_all(
            self._datasets[c.path] for c in self._steps_table.columns if not c.streamed
        )
        row += len(self._pending)
        parts = StreamedStep(self.path, row, {c.path: self._datasets[c.path] for c in columns})
        try:
            for column in columns:
                self._datasets[column.path].resize(row + 1, axis=0)
            yield parts
            if parts.rows is None:
                raise RuntimeError("Call set_rows() with the step's other columns in its block.")
            self._pending.append(record_of(self._tables, self._step_offset + step, parts.rows))
            self._last_step = step
            self.flush()
        except BaseException:
            # A failed flush has rolled back its block, and the step's tensors with it:
            # the step's other columns alone must not be retried.
            self._pending.clear()
            with contextlib.suppress(OSError, RuntimeError):
                for column in columns:
                    self._datasets[column.path].resize(row, axis=0)
            raise

    def flush(self) -> None:
        """Waits for a block being written in the background, then writes the buffered
        steps as one block and flushes the file to disk.

        Raises:
            OSError: if the block cannot be written (a full disk, say). The file then
                keeps the rows of every block written before; the block stays buffered,
                so a later `flush()` may retry it.
        """
        self._require_open()
        self._wait_for_background()
        if not self._pending:
            return
        self._write_block(self._pending)
        self._pending = []
        self._last_block = time.monotonic()

    def _wait_for_background(self) -> None:
        """Waits for the block being written in the background; raises its error, with
        the block buffered again in front of the steps buffered since."""
        failure = self._background.finish()
        if failure is None:
            return
        block, error = failure
        self._pending = block + self._pending
        if isinstance(error, OSError):
            raise error  # already says what failed and what the file keeps
        raise RuntimeError(
            f"Writing a block of the gradient log '{self.path}' in the background failed: "
            f"{type(error).__name__}: {error}. The file keeps every block written before "
            "this one; the block stays buffered."
        ) from error

    def _checks_now(self, checked: bool) -> bool:
        """Whether a step is checked as it comes: if asked, and the first after `open()`."""
        return checked or self._last_step is None

    def _write_block(self, block: Block) -> None:
        """Writes `block` (buffered steps) to the file, or none of it."""
        file = self._require_open()
        records = blocks.records_of(self._tables, block)  # before the file is touched
        try:
            append_block(file, self._datasets, self._tables, records)
        except (OSError, RuntimeError) as error:
            raise files.io_error(
                "Cannot write the gradient log",
                self.path,
                error,
                "The file keeps every block written before this one.",
            ) from error
        self._written_step = int(records[-1][self._steps_table.step_column.path][-1])

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
            close_without_writing(file, self._datasets)
            raise
        except BaseException:
            self._background.finish()  # interrupted while waiting for it
            file.close()
            raise
        else:
            file.close()
        finally:
            self._background.stop()
            self._file, self._datasets, self._pending = None, {}, []
            _OPEN_WRITERS.pop(os.path.realpath(self.path), None)

    def __enter__(self: _Self) -> _Self:
        if self._file is None:
            self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._file is not None else "closed"
        return f"<{type(self).__name__} '{self.path}' ({state}), a {self.layout.description}>"

    def _require_open(self) -> h5py.File:
        if self._file is None:
            raise RuntimeError(
                f"The {type(self).__name__} for '{self.path}' is not open. Call open() first."
            )
        return self._file


def _close_open_writers() -> None:
    """Writes what the writers still open hold when the process exits normally.

    A writer left open (a script that never closes it) may still hold its last
    steps in memory.
    """
    for writer in list(_OPEN_WRITERS.values()):
        if writer._process != os.getpid():
            continue  # a forked child exiting: the file is its parent's to write
        try:
            writer.close()
        except OSError as error:
            print(f"keras_gradtrack: {error}", file=sys.stderr)


atexit.register(_close_open_writers)
