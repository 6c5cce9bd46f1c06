"""The Keras callbacks: the gradient logs of `fit` and where else its statistics go.

* `HDF5GradientLogger` (`hdf5.py`): per-example and per-step statistics to an HDF5 log.
* `OutputGradientLogger` (`output_gradients.py`): per-output-feature weight gradients.
* `GradientStatisticsToLogs` (`statistics_to_logs.py`): per-step statistics in `fit`'s logs.
* `TensorBoardGradientLogger` (`tensorboard.py`): statistics as TensorBoard summaries;
  the event files themselves, during `fit` or from a log, are `tensorboard_events.py`.

Each name is imported on first use, so that `write_tensorboard` (from a log) does
not import the training callbacks.

Example:

```python
from keras_gradtrack.callbacks import HDF5GradientLogger

model.fit(x, y, callbacks=[HDF5GradientLogger("run.h5")])
```
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keras_gradtrack.callbacks.hdf5 import HDF5GradientLogger
    from keras_gradtrack.callbacks.output_gradients import OutputGradientLogger
    from keras_gradtrack.callbacks.statistics_to_logs import GradientStatisticsToLogs
    from keras_gradtrack.callbacks.tensorboard import TensorBoardGradientLogger
    from keras_gradtrack.callbacks.tensorboard_events import write_tensorboard

# Public name -> the module that defines it.
_LAZY = {
    "GradientStatisticsToLogs": "keras_gradtrack.callbacks.statistics_to_logs",
    "HDF5GradientLogger": "keras_gradtrack.callbacks.hdf5",
    "OutputGradientLogger": "keras_gradtrack.callbacks.output_gradients",
    "TensorBoardGradientLogger": "keras_gradtrack.callbacks.tensorboard",
    "write_tensorboard": "keras_gradtrack.callbacks.tensorboard_events",
}

__all__ = [
    "GradientStatisticsToLogs",
    "HDF5GradientLogger",
    "OutputGradientLogger",
    "TensorBoardGradientLogger",
    "write_tensorboard",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_gradtrack.callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
