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
    from keras_gradtrack.engine.preflight import check
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
    "check": "keras_gradtrack.engine.preflight",
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


# On the JAX backend the model classes come from the JAX engine (which imports no
# TensorFlow); everything else is shared.
_JAX_ENGINE = "keras_gradtrack.backends.jax"
_JAX_NAMES = ("GradientTrackingMixin", "GradientTrackingModel", "GradientTrackingSequential")


# The Keras backends whose steps are tracked; on others (PyTorch) the model classes are
# refused by name, and reading logs (GradientLog, the command line) works as anywhere.
_TRACKED_BACKENDS = ("tensorflow", "jax")


def _keras_runs_on_jax() -> bool:
    import keras

    return bool(keras.backend.backend() == "jax")


def _refuse_untracked_backend(name: str) -> None:
    import keras

    backend = keras.backend.backend()
    if backend not in _TRACKED_BACKENDS:
        raise NotImplementedError(
            f"keras_gradtrack.{name} tracks per-example gradients on Keras' TensorFlow "
            f"and JAX backends; the {backend} backend is not tracked yet (GradientLog and "
            "the command line read logs on any). Set KERAS_BACKEND=tensorflow or "
            f"KERAS_BACKEND=jax. Received: keras.backend.backend() == {backend!r}"
        )


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_gradtrack' has no attribute {name!r}")
    module = _LAZY[name]
    if name in _JAX_NAMES:
        _refuse_untracked_backend(name)
    if name in _JAX_NAMES and _keras_runs_on_jax():
        module = _JAX_ENGINE
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
if "keras" in sys.modules and sys.modules["keras"].backend.backend() in _TRACKED_BACKENDS:
    importlib.import_module(_JAX_ENGINE if _keras_runs_on_jax() else "keras_gradtrack.models.model")
