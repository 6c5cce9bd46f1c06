"""Reading and writing keras_gradtrack HDF5 logs; the layout is in `schema`."""

from keras_gradtrack.io.reader import GradientLog
from keras_gradtrack.io.writer import LogWriter

__all__ = ["GradientLog", "LogWriter"]
