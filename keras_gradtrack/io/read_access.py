"""Opening a log for reading so that a damaged file fails at once instead of hanging.

In SWMR mode HDF5 retries a metadata read whose checksum fails (a writer may be
halfway through updating it), sleeping twice as long after each attempt, 100
attempts by default: on a damaged file that wait never ends. h5py does not expose
`H5Pset_metadata_read_attempts`, so it is called on h5py's own HDF5 library through
ctypes: a damaged file then fails within about a second.

A file shorter than the end-of-file address its superblock records is not damaged
by itself (a writer stopped by a full disk leaves space it had claimed unwritten),
so that address only explains an error once HDF5 has found one.
"""

import contextlib
import ctypes
import functools
import glob
import os
import struct
from collections.abc import Callable, Iterator

import h5py

# Sleeps double from 1 ns: 30 attempts sleep about one second in all.
READ_ATTEMPTS = 30
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
RECOVERY_HINT = (
    "If the file is a copy, copy it again from the original. A log whose writer was "
    "killed is not damaged: it opens as it is (see docs/reliability.md)."
)


def open_for_reading(path: str) -> h5py.File:
    """Opens `path` read-only, in SWMR mode when the file allows it."""
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    set_read_attempts = _read_attempts_setter()
    if set_read_attempts is not None:
        set_read_attempts(access.id, READ_ATTEMPTS)
    try:
        # SWMR lets the file be read while a writer is appending to it, and opens
        # files whose writer was killed (plain opens refuse those).
        flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
        return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=access))
    except OSError:
        return h5py.File(path, "r")


@contextlib.contextmanager
def damage_reported(path: str) -> Iterator[None]:
    """Turns HDF5's errors while reading a log into an OSError that says it is damaged."""
    try:
        yield
    except (OSError, RuntimeError, KeyError) as error:
        reason = error.args[0] if error.args else error
        recorded_end = _recorded_end(path)
        size = os.path.getsize(path)
        if recorded_end is not None and size < recorded_end:
            reason = f"{reason}; it holds {size} of the {recorded_end} bytes its header records"
        raise OSError(
            f"Cannot read the gradient log '{path}': it is damaged ({reason}). {RECOVERY_HINT}"
        ) from error


def _recorded_end(path: str) -> int | None:
    """The end-of-file address the superblock at the start of `path` records, if any."""
    with open(path, "rb") as file:
        head = file.read(64)
    if not head.startswith(HDF5_SIGNATURE) or len(head) < 16:
        return None  # a user block before the superblock: left unexplained
    version = head[8]
    # Superblocks 0 and 1 hold more fields before their addresses than 2 and 3.
    offset_size, addresses = (
        (head[13], 24 if version == 0 else 28) if version < 2 else (head[9], 12)
    )
    formats = {4: "<I", 8: "<Q"}
    # The addresses: base, then (free space or superblock extension), then end of file.
    end_field = addresses + 2 * offset_size
    if offset_size not in formats or len(head) < end_field + offset_size:
        return None
    (base,) = struct.unpack_from(formats[offset_size], head, addresses)
    (end,) = struct.unpack_from(formats[offset_size], head, end_field)
    return base + end


@functools.cache
def _read_attempts_setter() -> Callable[[int, int], int] | None:
    """`H5Pset_metadata_read_attempts` of the HDF5 library h5py uses, if it can be found."""
    candidates = []
    if os.path.exists("/proc/self/maps"):  # Linux: the libraries this process has loaded
        with open("/proc/self/maps") as maps:
            candidates += [
                line.split()[-1]
                for line in maps
                if "libhdf5" in line and "libhdf5_hl" not in line and "/" in line
            ]
    package = os.path.dirname(h5py.__file__)
    for pattern in ("../h5py.libs/libhdf5-*", ".dylibs/libhdf5.*", "hdf5.dll"):
        candidates += glob.glob(os.path.join(package, pattern))
    probe = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    for candidate in dict.fromkeys(candidates):
        try:
            function = ctypes.CDLL(candidate).H5Pset_metadata_read_attempts
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
        # Only h5py's own copy of the library knows the property list h5py made.
        if function(probe.id, READ_ATTEMPTS) >= 0:
            return function
    return None
