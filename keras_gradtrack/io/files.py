"""The file system side of writing a log: path checks, opening, moving into place, errors."""

import contextlib
import errno
import os
import re
import secrets
import tempfile
from collections.abc import Mapping
from typing import Any

import h5py

from keras_gradtrack.io.checks import check_same_layout
from keras_gradtrack.io.discard import close_without_writing
from keras_gradtrack.io.hdf5_tables import LIBVER, Table, create_datasets, drop_incomplete_rows


def check_path(path: str, *, overwrite: bool, append: bool) -> None:
    """Raises if a log cannot be written at `path` with these flags; writes nothing.

    Raises:
        ValueError: if both `overwrite` and `append` are set.
        IsADirectoryError: if `path` is a directory.
        FileNotFoundError: if the parent directory does not exist.
        NotADirectoryError: if the parent path is not a directory.
        FileExistsError: if `path` exists and neither flag is set.
        PermissionError: if the file, or the directory a new file goes to, is not
            writable.
    """
    if overwrite and append:
        raise ValueError(
            "Pass at most one of overwrite=True (replace the file) and append=True "
            f"(continue it). Received: {overwrite=}, {append=}"
        )
    if os.path.isdir(path):
        raise IsADirectoryError(f"Expected the path of a log file. Received a directory: '{path}'")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(directory):
        raise FileNotFoundError(f"The directory of the log does not exist: '{directory}'")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"The parent of the log path is not a directory: '{directory}'")
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


def create(
    path: str,
    header: Mapping[str, Mapping[str, Any]],
    tables: Mapping[str, Table],
    compression: str | None,
    overwrite: bool,
) -> h5py.File:
    """Makes a new log at `path` holding `header` and every table, open in SWMR mode.

    Until it is in SWMR mode, a file killed half-made opens neither with nor
    without swmr=True; so it is made under a hidden name and moved into place only
    then. `path` is thus always absent, the old file, or a readable log.

    Raises:
        FileExistsError: if a file appeared at `path` meanwhile (unless `overwrite`).
        OSError: naming the log and the reason if it cannot be made; no file is left.
    """
    directory, name = os.path.split(os.path.abspath(path))
    staging = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        file = open_h5py_file(staging, "x")
        try:
            create_datasets(file, header, tables, compression)
            # SWMR readers need every dataset to exist before the switch.
            file.swmr_mode = True
            move_into_place(staging, path, replace=overwrite)
        except BaseException:
            # The staging file is removed: nothing HDF5 still holds needs writing.
            close_without_writing(file, {})
            raise
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
        if isinstance(error, OSError | RuntimeError) and not isinstance(error, FileExistsError):
            raise io_error(
                "Cannot create the gradient log", path, error, "No file was written."
            ) from error
        raise
    return file


def open_to_append(path: str, layout: Any, tables: Mapping[str, Table]) -> tuple[h5py.File, int]:
    """Opens the log at `path` in SWMR mode to continue it; returns it and its steps.

    Rows of a block a killed writer left half-written are cut off first.

    Raises:
        ValueError: if the file is not a log of the same layout as `layout`.
    """
    if not h5py.is_hdf5(path):
        raise ValueError(
            f"Cannot append to '{path}': it is not a {layout.description} (not an HDF5 file)."
        )
    # Checked read-only first, so a file that is not a matching log is left as it is.
    with open_h5py_file(path, "r") as file:
        found = type(layout).read(file, path)
    check_same_layout(path, found=found, given=layout)
    # Opened in SWMR mode at once: a file opened for writing without it, if killed
    # before the switch, opens neither with nor without swmr=True.
    file = open_h5py_file(path, "r+", swmr=True)
    try:
        num_steps = drop_incomplete_rows(file, tables)
    except BaseException:
        file.close()
        raise
    return file, num_steps


def move_into_place(staging: str, path: str, *, replace: bool) -> None:
    """Moves the finished `staging` file to `path`; never replaces a file unless `replace`."""
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


def open_h5py_file(path: str, mode: str, *, swmr: bool = False) -> h5py.File:
    """Opens `path` with h5py in `mode`; `swmr=True` opens it for writing in SWMR mode.

    Raises:
        OSError: naming the likely holder when HDF5 refuses the file as in use.
    """
    try:
        if swmr:
            # h5py only opens files for reading in SWMR mode; the low-level call can write.
            access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
            bounds = {"v110": h5py.h5f.LIBVER_V110, "latest": h5py.h5f.LIBVER_LATEST}
            access.set_libver_bounds(*(bounds[bound] for bound in LIBVER))
            flags = h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE
            return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=access))
        return h5py.File(path, mode, libver=LIBVER)
    except OSError as error:
        if "lock" not in str(error) and "already open" not in str(error):
            raise
        raise OSError(
            f"Cannot open '{path}' for writing: {error}. Another process may hold it open "
            "(close any GradientLog or h5py.File reading it). If a previous writer was "
            "killed, HDF5 still marks the file as open for writing; HDF5's `h5clear -s` "
            "tool removes that mark."
        ) from error


def io_error(failed: str, path: str, error: BaseException, outcome: str) -> OSError:
    """An OSError naming the log and the system's reason, from an h5py error."""
    # h5py raises RuntimeError or OSError with HDF5's message, which holds the errno.
    found = re.search(r"errno = (\d+)", str(error))
    code = int(found.group(1)) if found else getattr(error, "errno", None)
    reason = os.strerror(code) if code else str(error)
    message = f"{failed} '{path}': {reason}. {outcome}"
    return OSError(code, message) if code else OSError(message)


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
