"""Reading and writing keras_gradtrack HDF5 logs; the layouts are in `schema`.

`keras_gradtrack.GradientLog` (in `keras_gradtrack.analysis`) is the reader with
analyses on top; this package never imports `analysis`, TensorFlow or Keras.
"""

from keras_gradtrack.io.block_writer import BlockWriter
from keras_gradtrack.io.reader import LogReader
from keras_gradtrack.io.writer import LogWriter

__all__ = ["BlockWriter", "LogReader", "LogWriter"]
