"""keras_gradtrack: exact per-example gradient statistics for Keras 3 training.

Example:

```python
import keras, keras_gradtrack as kgt

model = kgt.GradientTrackingModel(inputs, outputs)      # instead of keras.Model
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, callbacks=[kgt.HDF5GradientLogger("run.h5")])
kgt.GradientLog("run.h5").per_example("cosine")
```
"""

from keras_gradtrack import autodiff, statistics
from keras_gradtrack.callbacks import HDF5GradientLogger
from keras_gradtrack.io.reader import GradientLog
from keras_gradtrack.model import (
    GradientTrackingMixin,
    GradientTrackingModel,
    GradientTrackingSequential,
)
from keras_gradtrack.output_logger import OutputGradientLogger
from keras_gradtrack.version import __version__

__all__ = [
    "GradientLog",
    "GradientTrackingMixin",
    "GradientTrackingModel",
    "GradientTrackingSequential",
    "HDF5GradientLogger",
    "OutputGradientLogger",
    "__version__",
    "autodiff",
    "statistics",
]
