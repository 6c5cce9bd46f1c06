"""`GradientStatisticsToLogs`: per-step gradient statistics in the `logs` of `fit`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from keras_gradtrack import statistics as statistics_module
from keras_gradtrack.callbacks.base import (
    StatisticsCallback,
    check_positive_counts,
    require_tracking_model,
)
from keras_gradtrack.engine.schedule import StepReport
from keras_gradtrack.statistics import Statistic

# The per-step built-ins: one number per step each.
DEFAULT_LOGS_STATISTICS = (
    "gradient_diversity",
    "noise_scale",
    "batch_grad_norm",
    "mean_cosine",
    "frac_negative_cosine",
)


class GradientStatisticsToLogs(StatisticsCallback):
    """Puts per-step gradient statistics into the `logs` every later callback receives.

    Keras passes one `logs` dict to the callbacks of `fit` in list order (the
    progress bar and `History` come last), so placed *before* `CSVLogger`,
    `TensorBoard` or a third-party logger (Weights & Biases' Keras callbacks, ...),
    this callback makes them show the statistics with no code of theirs:

    * batch logs, on tracked steps only: the step's values. Untracked steps
      (`every_n_steps > 1`) get no entry, never a stale value.
    * epoch logs: the mean of each statistic over the epoch's tracked steps (NaN
      for an epoch without one; non-finite step values make the mean non-finite too).

    Cost: the statistics are computed in the tracked step and copied to the host
    with it (a few numbers); this callback then adds about a dict update per step.
    The cost is the tracked step's own: nothing beyond it when an
    `HDF5GradientLogger` tracks the same steps. See the TensorBoard docs page for
    measurements.

    Args:
        statistics: Names or `Statistic` objects with one value per step (not per
            example or per layer). Defaults to `gradient_diversity`, `noise_scale`,
            `batch_grad_norm`, `mean_cosine` and `frac_negative_cosine`.
        every_n_steps: Track one step in every `every_n_steps` (as
            `HDF5GradientLogger`; at the same cadence the two share the steps).
        prefix: Put before every key (e.g. `"grad/"`), to group or to avoid a metric
            of the same name.

    Raises:
        ValueError: At construction, for an unknown statistic, one that is not
            a single number per step, or a non-positive `every_n_steps`. At the
            first tracked step, for a key the logs already hold (a metric of the
            same name: use `prefix`).

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[
        kgt.GradientStatisticsToLogs(),           # first: the loggers below see the values
        keras.callbacks.CSVLogger("epochs.csv"),  # columns gradient_diversity, ...
        keras.callbacks.TensorBoard("tb/", update_freq="batch"),
    ])
    ```
    """

    def __init__(
        self,
        statistics: Iterable[str | Statistic] | None = None,
        every_n_steps: int = 1,
        prefix: str = "",
    ):
        super().__init__()
        check_positive_counts([("every_n_steps", every_n_steps)])
        self.statistics = statistics_module.resolve(
            DEFAULT_LOGS_STATISTICS if statistics is None else statistics
        )
        not_scalar = [s.name for s in self.statistics if s.per_example or s.per_layer]
        if not_scalar:
            raise ValueError(
                "Keras logs hold one number per name: expected statistics with one value "
                f"per step, such as {list(DEFAULT_LOGS_STATISTICS)}. Received per-example "
                f"or per-layer statistics: {not_scalar}"
            )
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        # Every tracked step's values since the last batch end (several with
        # `steps_per_execution > 1`).
        self._pending: list[dict[str, float]] = []
        self._epoch_values: dict[str, list[float]] = {}

    @property
    def keys(self) -> list[str]:
        """The keys this callback adds to the logs."""
        return [f"{self.prefix}{s.name}" for s in self.statistics]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        require_tracking_model(self.model, self)
        self._pending = []
        self.subscribe(self._consume)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_values = {key: [] for key in self.keys}

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # The steps' reports arrived in the train function, before this call; the
        # logs show the last step's values, the epoch's mean counts every step.
        pending, self._pending = self._pending, []
        if not pending or logs is None:
            return
        values = pending[-1]
        taken = sorted(set(values) & set(logs))
        if taken:
            raise ValueError(
                f"The logs already hold {taken}, so GradientStatisticsToLogs would replace "
                "them: pass `prefix=` (e.g. prefix='grad/'). Received: logs keys "
                f"{sorted(logs)}"
            )
        logs.update(values)
        for step_values in pending:
            for key, value in step_values.items():
                self._epoch_values.setdefault(key, []).append(value)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None:
            return
        for key in self.keys:
            steps = self._epoch_values.get(key, [])
            logs[key] = float(np.mean(steps)) if steps else float("nan")

    def _consume(self, report: StepReport) -> None:
        if report.values is not None:
            self._pending.append(_step_values(report.values, self.statistics, self.prefix))


def _step_values(
    values: Mapping[str, np.ndarray], statistics: Iterable[Statistic], prefix: str
) -> dict[str, float]:
    return {f"{prefix}{s.name}": float(values[s.name]) for s in statistics}
