"""What the package's callbacks share: their checks, their writer's `close`, the subscription.

* `FileLogger`: one file at `path`, `append=` / `overwrite=`; after `close` a later
  `fit` with the same logger continues the file (`HDF5GradientLogger`,
  `OutputGradientLogger`).
* `StatisticsCallback`: takes statistics from the model's tracked steps
  (`HDF5GradientLogger`, `TensorBoardGradientLogger`, `GradientStatisticsToLogs`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import keras

from keras_gradtrack import statistics as statistics_module
from keras_gradtrack.engine.schedule import StepReport
from keras_gradtrack.statistics import Statistic
from keras_gradtrack.version import __version__


def is_chief(model: Any) -> bool:
    """Whether this process writes the log: always, except non-chief multi-worker tasks
    (on JAX: processes but the first; on PyTorch, one process writes)."""
    if keras.backend.backend() == "torch":
        return True
    if keras.backend.backend() == "jax":
        from keras_gradtrack.backends.jax.distribution import writes_log

        return writes_log()
    resolver = getattr(model.distribute_strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    cluster = resolver.cluster_spec().as_dict()
    if "chief" in cluster:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def require_tracking_model(model: Any, callback: keras.callbacks.Callback) -> None:
    """Raises unless `model` can compute gradient statistics for `callback` (with the
    engine of Keras' backend)."""
    if keras.backend.backend() == "jax":
        from keras_gradtrack.backends.jax.mixin import GradientTrackingMixin as JaxTrackingMixin

        tracking_mixin: type = JaxTrackingMixin
    elif keras.backend.backend() == "torch":
        from keras_gradtrack.backends.torch.mixin import GradientTrackingMixin as TorchTrackingMixin

        tracking_mixin = TorchTrackingMixin
    else:
        from keras_gradtrack.models.trainer import GradientTrackingMixin

        tracking_mixin = GradientTrackingMixin
    if not isinstance(model, tracking_mixin):
        raise TypeError(
            f"{type(callback).__name__} needs a model built with "
            "keras_gradtrack.GradientTrackingModel (or GradientTrackingMixin). "
            f"Received: a {type(model).__name__}"
        )


def log_attrs(model: Any) -> dict[str, str]:
    """The attributes a log of `model`'s training carries: the versions, the model's
    name, and the Keras backend whose engine computed the values (TensorFlow's version
    read from its installed metadata: a JAX process need not import it)."""
    return {
        "library_version": __version__,
        "keras_version": keras.__version__,
        "tensorflow_version": installed_version("tensorflow"),
        "model_name": model.name,
        "backend": keras.backend.backend(),
    }


@functools.cache
def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or "not installed" (read once: reading a
    package's metadata scans the installed packages, a millisecond per logger)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_positive_counts(counts: Iterable[tuple[str, Any]]) -> None:
    """Raises ValueError for the first `(name, value)` whose value is not a positive int."""
    for name, value in counts:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected `{name}` to be a positive int. Received: {value!r}")


def refuse_square_statistics(statistics: list[Statistic], why: str) -> None:
    """Raises ValueError for a `(batch, batch)` statistic; `why` says what it lacks here."""
    square = [s.name for s in statistics if isinstance(s, statistics_module.PairwiseCosine)]
    if square:
        raise ValueError(
            f"{square} is a (batch, batch) matrix per step and {why} "
            f"Received: statistics={[s.name for s in statistics]}"
        )


class WriterCallback(keras.callbacks.Callback):
    """A callback that writes through `self.writer` (None while nothing is open)."""

    writer: Any = None

    def close(self) -> None:
        """Writes what is buffered and closes the writer (idempotent)."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


class FileLogger(WriterCallback):
    """A callback writing one file: `append=` continues it, `overwrite=` replaces it.

    Raises:
        ValueError: At construction, for both `append` and `overwrite`.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool, overwrite: bool):
        super().__init__()
        if append and overwrite:
            raise ValueError(
                "Pass at most one of `append` and `overwrite`. "
                f"Received: append={append}, overwrite={overwrite}"
            )
        self.path = os.fspath(path)
        self.append = append
        self.overwrite = overwrite

    def close(self) -> None:
        """Writes what is buffered and closes the file (idempotent); a later `fit` with
        this logger continues it.

        Raises OSError if the buffered rows cannot be written (a full disk, say); the
        file is closed all the same and keeps every block written before.
        """
        if self.writer is not None:
            self.append, self.overwrite = True, False
        super().close()


class StatisticsCallback(WriterCallback):
    """A callback taking gradient statistics from the model's tracked steps.

    A subclass sets `statistics` and `every_n_steps`, checks the model with
    `require_tracking_model` and calls `subscribe` in `on_train_begin`; `on_train_end`
    ends the subscription and closes the writer.
    """

    # `fit` checks that examples do not mix before the first step this callback tracks.
    subscribes_to_gradients = True
    statistics: list[Statistic]
    every_n_steps: int

    def subscribe(
        self,
        consume: Callable[[StepReport], None],
        finish: Callable[[], None] | None = None,
        requests: Sequence[Any] = (),
    ) -> None:
        """Subscribes `consume` to the model's tracked steps, as
        `GradientTrackingState.subscribe` (`finish`, `requests`) says."""
        self.model.gradient_tracking.subscribe(
            id(self),
            self.statistics,
            self.every_n_steps,
            consume,
            finish=finish,
            requests=requests,
        )

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.model.gradient_tracking.unsubscribe(id(self))
        self.close()
