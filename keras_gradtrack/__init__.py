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

import importlib
import sys
from typing import TYPE_CHECKING, Any

from keras_gradtrack.version import __version__

if TYPE_CHECKING:
    from keras_gradtrack import attribution, autodiff, privacy, rules, statistics
    from keras_gradtrack.analysis import GradientLog
    from keras_gradtrack.callbacks.hdf5 import HDF5GradientLogger
    from keras_gradtrack.callbacks.output_gradients import OutputGradientLogger
    from keras_gradtrack.callbacks.statistics_to_logs import GradientStatisticsToLogs
    from keras_gradtrack.callbacks.tensorboard import TensorBoardGradientLogger
    from keras_gradtrack.callbacks.tensorboard_events import write_tensorboard
    from keras_gradtrack.checking import check
    from keras_gradtrack.models.convert import convert_to_group_normalization
    from keras_gradtrack.models.model import GradientTrackingModel, GradientTrackingSequential
    from keras_gradtrack.models.trainer import GradientTrackingMixin
    from keras_gradtrack.rules import register_rule

# Public name -> the module that defines it (None: the name is a submodule).
# They are imported on first use, so that reading logs (GradientLog, the
# keras-gradtrack command, analysis and plots) never imports TensorFlow.
_LAZY = {
    "GradientLog": "keras_gradtrack.analysis",
    "GradientStatisticsToLogs": "keras_gradtrack.callbacks.statistics_to_logs",
    "GradientTrackingMixin": "keras_gradtrack.models.trainer",
    "GradientTrackingModel": "keras_gradtrack.models.model",
    "GradientTrackingSequential": "keras_gradtrack.models.model",
    "HDF5GradientLogger": "keras_gradtrack.callbacks.hdf5",
    "OutputGradientLogger": "keras_gradtrack.callbacks.output_gradients",
    "TensorBoardGradientLogger": "keras_gradtrack.callbacks.tensorboard",
    "attribution": None,
    "autodiff": None,
    "convert_to_group_normalization": "keras_gradtrack.models.convert",
    "check": "keras_gradtrack.checking",
    "register_rule": "keras_gradtrack.rules",
    "privacy": None,
    "rules": None,
    "statistics": None,
    "write_tensorboard": "keras_gradtrack.callbacks.tensorboard_events",
}

__all__ = [
    "GradientLog",
    "GradientStatisticsToLogs",
    "GradientTrackingMixin",
    "GradientTrackingModel",
    "GradientTrackingSequential",
    "HDF5GradientLogger",
    "OutputGradientLogger",
    "TensorBoardGradientLogger",
    "__version__",
    "attribution",
    "autodiff",
    "convert_to_group_normalization",
    "check",
    "privacy",
    "register_rule",
    "rules",
    "statistics",
    "write_tensorboard",
]


# On JAX and PyTorch the model classes come from that backend's engine (neither imports
# TensorFlow); everything else is shared.
_ENGINES = {
    "tensorflow": "keras_gradtrack.models",
    "jax": "keras_gradtrack.backends.jax",
    "torch": "keras_gradtrack.backends.torch",
}
_PROBED_ENGINE_MODULES = {
    "GradientTrackingMixin": "mixin",
    "GradientTrackingModel": "model",
    "GradientTrackingSequential": "model",
}


def _engine() -> str:
    """The package of the model classes for Keras' backend."""
    import keras

    backend = keras.backend.backend()
    if backend not in _ENGINES:
        raise NotImplementedError(
            "keras_gradtrack tracks per-example gradients on Keras' TensorFlow, JAX and "
            f"PyTorch backends; the {backend} backend is not tracked (GradientLog and the "
            "command line read logs on any). Received: keras.backend.backend() == "
            f"{backend!r}"
        )
    return _ENGINES[backend]


def _module_of(name: str) -> str | None:
    """The module that defines the public `name` on Keras' backend (None: a submodule)."""
    if name in _PROBED_ENGINE_MODULES:
        engine = _engine()
        if engine != _ENGINES["tensorflow"]:
            return f"{engine}.{_PROBED_ENGINE_MODULES[name]}"
    return _LAZY[name]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_gradtrack' has no attribute {name!r}")
    module = _module_of(name)
    value = (
        importlib.import_module(f"keras_gradtrack.{name}")
        if module is None
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


# `keras.models.load_model` finds the model classes only once they are
# registered: when Keras is already in use, register them now.
if "keras" in sys.modules and sys.modules["keras"].backend.backend() in _ENGINES:
    importlib.import_module(f"{_engine()}.model")
