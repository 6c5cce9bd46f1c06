"""`TensorBoardGradientLogger`: gradient statistics as TensorBoard scalars and histograms."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from keras_gradtrack import statistics as statistics_module
from keras_gradtrack.callbacks.base import (
    StatisticsCallback,
    check_positive_counts,
    is_chief,
    refuse_square_statistics,
    require_tracking_model,
)
from keras_gradtrack.callbacks.tensorboard_events import (
    DEFAULT_BUCKETS,
    StepSummaryWriter,
    summary_ops,
)
from keras_gradtrack.engine.schedule import StepReport
from keras_gradtrack.io.schema import LEARNING_RATE
from keras_gradtrack.statistics import Statistic


class TensorBoardGradientLogger(StatisticsCallback):
    """Writes gradient statistics to TensorBoard event files during `fit`.

    Every tracked step writes scalars: the per-step statistics
    (`gradient_diversity`, `noise_scale`, `batch_grad_norm`, `mean_cosine`,
    `frac_negative_cosine`), `learning_rate`, and the means over the step's
    examples of the per-example ones (`grad_norm_mean`, `loss_mean`,
    `layer_grad_norm_mean/<layer>`, ...). Every `histogram_every` tracked steps it
    also writes histograms of the step's per-example values (`grad_norm`, `cosine`,
    `loss`, `layer_grad_norm/<layer>`, `layer_cosine/<layer>`). The TensorBoard
    step is the model's training step (the step number an `HDF5GradientLogger`
    started with the same fit writes). Non-finite values (a cosine is NaN where a
    norm is 0) are left out of histograms and means.

    These are the tags `keras-gradtrack tensorboard run.h5 --logdir tb/` writes from
    a log afterwards. Open them with `tensorboard --logdir <log_dir>`.

    Args:
        log_dir: The directory of the event files (created if needed).
        statistics: Names or `Statistic` objects to write. Defaults to all built-in
            statistics except the opt-in ones.
        every_n_steps: Track one step in every `every_n_steps` (as
            `HDF5GradientLogger`; with both at the same cadence, the steps are shared).
        histogram_every: Write histograms for one tracked step in every this many.
        buckets: Buckets per histogram.

    Raises:
        ImportError: At construction, without the `tensorboard` package (the
            message names `pip install "keras-gradtrack[tensorboard]"`).
        ValueError: At construction, for an unknown statistic, a (B, B) statistic,
            or non-positive counts.
        NotADirectoryError, PermissionError: In `on_train_begin` (before any weight
            changes), for a `log_dir` that cannot be written.

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[
        kgt.HDF5GradientLogger("run.h5"),
        kgt.TensorBoardGradientLogger("tb/gradients", histogram_every=10),
    ])
    # then: tensorboard --logdir tb/
    ```
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        statistics: Iterable[str | Statistic] | None = None,
        every_n_steps: int = 1,
        histogram_every: int = 1,
        buckets: int = DEFAULT_BUCKETS,
    ):
        super().__init__()
        check_positive_counts(
            [
                ("every_n_steps", every_n_steps),
                ("histogram_every", histogram_every),
                ("buckets", buckets),
            ]
        )
        summary_ops()  # fails now, not after training started, without tensorboard
        self.log_dir = os.fspath(log_dir)
        self.statistics = statistics_module.resolve(statistics)
        refuse_square_statistics(self.statistics, "has no TensorBoard summary here.")
        self.every_n_steps = every_n_steps
        self.histogram_every = histogram_every
        self.buckets = buckets
        self._writes = True
        self._first_step = 0
        self._tracked = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        require_tracking_model(self.model, self)
        # Every worker tracks the same steps; only the chief writes them.
        self._writes = is_chief(self.model)
        if self._writes:
            from keras_gradtrack.callbacks.tensorboard_events import prepare_logdir

            prepare_logdir(self.log_dir)
        self._first_step = self.model.gradient_tracking.step
        self._tracked = 0
        self.subscribe(self._consume, finish=self.close)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.writer is not None:
            self.writer.flush()

    def _consume(self, report: StepReport) -> None:
        if report.values is None or not self._writes:
            return
        if self.writer is None:
            # The layer names are known once the first tracked step has built the model.
            self.writer = StepSummaryWriter(
                self.log_dir, self.model.tracked_layer_names, buckets=self.buckets
            )
        values = report.values
        self.writer.write_step(
            self._first_step + report.step,
            per_step={
                **{s.name: values[s.name] for s in self.statistics if not s.per_example},
                LEARNING_RATE: values[LEARNING_RATE],
            },
            per_example={s.name: values[s.name] for s in self.statistics if s.per_example},
            histograms=self._tracked % self.histogram_every == 0,
        )
        self._tracked += 1
