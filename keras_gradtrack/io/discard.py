"""Closing an HDF5 file after a failed write without HDF5 writing to it again.

After a failed write (a full disk, a file size limit) HDF5 keeps the chunks it could
not write and retries them when closing, which fails again: the datasets stay open
and print errors when garbage-collected. `close_without_writing` lets those last
writes go to a file in memory instead.
"""

import os

import h5py

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

# h5py objects of logs that could not be closed after a write error: never freed,
# as freeing them crashes HDF5.
_UNCLOSABLE: list[tuple[h5py.File, object]] = []


def close_without_writing(file: h5py.File, datasets: object) -> None:
    """Closes `file`, discarding what HDF5 still holds to write; leaves the file as is.

    The file on disk already holds every block before the failed one (the writer
    rolled that back). The log stays marked as open for writing, like that of a
    killed writer: readers open it with swmr=True.

    Args:
        file: the open file.
        datasets: the h5py objects of the file the caller holds; kept alive with it
            if the file cannot be closed.
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
