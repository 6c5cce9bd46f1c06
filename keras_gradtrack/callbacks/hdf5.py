"""`HDF5GradientLogger`: a Keras callback streaming gradient statistics to HDF5."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

import h5py
import keras
import numpy as np

from keras_gradtrack import statistics as statistics_module
from keras_gradtrack._keras_seam import compiled_loss, flatten_layers
from keras_gradtrack.callbacks.base import (
    FileLogger,
    StatisticsCallback,
    check_positive_counts,
    is_chief,
    log_attrs,
    refuse_square_statistics,
    require_tracking_model,
)
from keras_gradtrack.engine.attribution_requests import (
    AttributionRequest,
    SketchRequest,
    TargetExamples,
)
from keras_gradtrack.engine.device_rows import ScaledRows, deferred
from keras_gradtrack.engine.schedule import StepReport
from keras_gradtrack.io.checkpoints import (
    check_checkpoints,
    checkpoint_path,
    remove_checkpoints,
    save_checkpoint,
    write_privacy_history,
)
from keras_gradtrack.io.checks import check_flush_seconds
from keras_gradtrack.io.schema import (
    BATCH_SIZE,
    EXAMPLE_ID,
    GRADIENT_SKETCH,
    LEARNING_RATE,
    TARGET_INFLUENCE,
    SketchLayout,
)
from keras_gradtrack.io.writer import LogWriter
from keras_gradtrack.statistics import Statistic


def attribution_classes() -> tuple[type[TargetExamples], type[SketchRequest]]:
    """The classes of the targets' and the sketches' requests on the Keras backend: the
    TensorFlow engine's (imported only when asked for), or on JAX the requests as data,
    which the JAX engine computes itself (`backends/jax/attribution.py`; on PyTorch the
    tracked step refuses them)."""
    if keras.backend.backend() != "tensorflow":
        return TargetExamples, SketchRequest
    from keras_gradtrack.attribution.sketches import GradientSketch
    from keras_gradtrack.attribution.targets import TargetSet

    return TargetSet, GradientSketch


def privacy_of(model: Any) -> tuple[list[Statistic], dict[str, Any]]:
    """A private model's extra statistics and log attributes (none for another model:
    the private step is the TensorFlow engine's, imported only for a private model)."""
    if getattr(model, "privacy_settings", None) is None:
        return [], {}
    from keras_gradtrack.engine.private_logs import privacy_attrs, privacy_statistics

    return privacy_statistics(model), privacy_attrs(model)


def write_privacy_spent(model: Any, path: str) -> None:
    """Writes the privacy a private model spent (its `PrivacyAccountant`'s epsilon)
    into the closed log's root attributes; nothing for another model."""
    if getattr(model, "privacy_settings", None) is None:
        return
    from keras_gradtrack.engine.private_logs import privacy_spent_attrs

    spent = privacy_spent_attrs(model)
    if spent:
        with h5py.File(path, "r+") as file:
            file.attrs.update(spent)


class HDF5GradientLogger(StatisticsCallback, FileLogger):
    """Streams per-example and per-step gradient statistics to an HDF5 file.

    The file follows schema version 2 (see the docs): `/per_example/<stat>`
    holds one row per example seen, `/per_step/<stat>` one row per tracked
    step (plus `/per_step/learning_rate`, the rate the optimizer used at that
    step), `/layers` the per-layer column names. Rows are written in blocks:
    every `flush_every` tracked steps, or sooner once `flush_seconds` have
    passed since the last block, each on a thread of its own while training
    goes on (a block that cannot be written ends `fit` at the next step with
    its `OSError`). The file is opened in SWMR mode, so `GradientLog` can read
    it while training runs. A `fit` that fails before its first tracked step
    reaches the file (a refused loss reduction, `add_loss`, an option the backend
    lacks) removes the file it made (never one that existed before), so the
    corrected `fit` writes the same path.

    Args:
        path: The `.h5` file to write.
        statistics: Names or `Statistic` objects to log. Defaults to all
            built-in statistics except the opt-in ones.
        every_n_steps: Track one step in every `every_n_steps`; the other steps
            run Keras' untracked train step at plain `fit` cost.
        flush_every: Most tracked steps buffered before a block is written.
        flush_seconds: A block is also written at the first tracked step this
            many seconds after the previous block, so a crash loses at most
            that much training time (and the block then being written) and a
            live reader lags at most that much (and that block's write time);
            `None` writes blocks of exactly `flush_every` steps.
        append: Continue an existing log (step numbers continue after its last).
        overwrite: Replace an existing file.
        compression: HDF5 compression filter (`"gzip"`, `"lzf"` or None).
        targets: `(x, y)` of examples to explain (TracIn, see the attribution
            docs): every tracked step also logs, per example row i,
            `/per_example/target_influence[i, j] = lr_t <g_i, g_target_j>` at the
            weights of that step, before its update. A dict `x` may hold
            `"example_id"` (default ids `0..T-1`). Needs a model compiled with a
            loss; the targets' gradients are taken in inference mode.
        sketch_dim: For targets chosen after training: log a sketch of each
            example's gradient, `/per_example/gradient_sketch` (each side of each
            weight matrix projected to at most `sketch_dim` dimensions), and save
            checkpoints; `keras_gradtrack.attribution.estimate_influence` reads them.
        sketch_seed: The seed of the sketches' random projections.
        checkpoint_every: Save the weights every this many steps, beside the log
            (`<log>.checkpoints/step_<step>.weights.h5`, the weights that step
            began with). With `sketch_dim` and no `checkpoint_every`, at the
            first step of every epoch.

    Raises:
        ValueError: At construction, for an unknown statistic (the message lists
            the valid names), both `append` and `overwrite`, non-positive step
            counts, or targets that are not one row per target with distinct
            integer ids. In `on_train_begin` (before any weight changes), for
            an existing file without `append`/`overwrite`, a missing or
            unwritable directory, a log of another model (or other targets)
            when appending, or targets for a model compiled without a loss.
        FileExistsError: In `on_train_begin`, for checkpoints of another log
            beside the path, without `append`/`overwrite`.

    Example:

    ```python
    logger = kgt.HDF5GradientLogger("run.h5", every_n_steps=10)
    model.fit(x, y, epochs=5, callbacks=[logger])
    kgt.GradientLog("run.h5").per_example("cosine")

    # Which training examples pushed the model toward or away from 64 test examples:
    logger = kgt.HDF5GradientLogger("run.h5", targets=(x_test[:64], y_test[:64]))
    ```
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        statistics: Iterable[str | Statistic] | None = None,
        every_n_steps: int = 1,
        flush_every: int = 100,
        flush_seconds: float | None = 1.0,
        append: bool = False,
        overwrite: bool = False,
        compression: str | None = "gzip",
        targets: Any = None,
        sketch_dim: int | None = None,
        sketch_seed: int = 0,
        checkpoint_every: int | None = None,
    ):
        super().__init__(path, append=append, overwrite=overwrite)
        counts = [("every_n_steps", every_n_steps), ("flush_every", flush_every)]
        if checkpoint_every is not None:
            counts.append(("checkpoint_every", checkpoint_every))
        check_positive_counts(counts)
        check_flush_seconds(flush_seconds)
        self.statistics = statistics_module.resolve(statistics)
        refuse_square_statistics(
            self.statistics,
            "is not written to the log; compute it with `model.gradient_statistics(x, y, "
            "statistics=['pairwise_cosine'])`.",
        )
        self.every_n_steps = every_n_steps
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.compression = compression
        target_class, sketch_class = attribution_classes()
        self.targets = None if targets is None else target_class.from_argument(targets)
        self.sketch = None if sketch_dim is None else sketch_class(sketch_dim, sketch_seed)
        self.checkpoint_every = checkpoint_every
        # Sketches are only of use with weights to sketch targets at.
        self._checkpoints = checkpoint_every is not None or sketch_dim is not None
        self._first_step = 0
        self._tracking: Any = None
        self._epoch = 0
        self._epoch_position = 0
        self._writes = True
        # What this fit made, so that a fit refused before its first step leaves no file.
        self._created_file = False
        self._steps_written = 0
        self._saved_checkpoints: list[Any] = []

    # -- lifecycle ------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        require_tracking_model(self.model, self)
        steps = getattr(self.model, "steps_per_execution", 1)
        if self.checkpoint_every is not None and self.checkpoint_every % steps:
            # Keras starts a batch (where the weights are saved) every `steps` steps.
            raise ValueError(
                "Checkpoints are saved before a step starts, and with steps_per_execution "
                f"={steps} a step starts from Python only every {steps} steps: pass a "
                f"checkpoint_every that is a multiple of it. Received: "
                f"checkpoint_every={self.checkpoint_every}"
            )
        # Every worker tracks the same steps (the statistics are collective);
        # only the chief writes them.
        self._writes = is_chief(self.model)
        if self._writes:
            LogWriter.check_path(self.path, overwrite=self.overwrite, append=self.append)
            if self._checkpoints:
                check_checkpoints(self.path, overwrite=self.overwrite, append=self.append)
        requests: list[AttributionRequest] = []
        if self.targets is not None:
            if compiled_loss(self.model) is None:
                raise ValueError(
                    "targets= needs the model's loss for the targets' gradients: compile "
                    f"the model with `loss=`. Received: model {self.model.name!r} without one."
                )
            requests.append(self.targets)
        if self.sketch is not None:
            requests.append(self.sketch)
        # A private model's log also holds the pre-clip norms and the fraction clipped.
        private, _ = privacy_of(self.model)
        names = {statistic.name for statistic in private}
        self.statistics = [s for s in self.statistics if s.name not in names] + private
        # Read without `self.model`, which on JAX copies the training state into the
        # model's variables each time: once per checkpoint, not once per step.
        self._tracking = self.model.gradient_tracking
        self._first_step = self._tracking.step
        self._created_file, self._steps_written, self._saved_checkpoints = False, 0, []
        # Called only when the fit raises (`on_train_end` ends the subscription first).
        self.subscribe(self._consume, finish=self._close_after_error, requests=requests)
        # A subclassed model's layers may only be built by the first step; the
        # layer names (and the file's datasets) wait for it then.
        if self._writes and all(layer.built for layer in flatten_layers(self.model)):
            self._open_writer()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._epoch_position = 0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not (self._checkpoints and self._writes):
            return
        step = self._tracking.step - self._first_step
        due = step % self.checkpoint_every == 0 if self.checkpoint_every else batch == 0
        if not due or not self.model.built:
            return
        if self.writer is None:
            self._open_writer()
        assert self.writer is not None
        path = checkpoint_path(self.path, self.writer.step_offset + step)
        path.parent.mkdir(exist_ok=True)
        # Before the step runs: the weights of its gradients, as the log's rows use them.
        save_checkpoint(self.model, path)
        self._saved_checkpoints.append(path)
        if getattr(self.model, "privacy_settings", None) is not None:
            from keras_gradtrack.privacy.history import history_json

            write_privacy_history(path, history_json(self.model.privacy_history))

    def _consume(self, report: StepReport) -> None:
        if report.values is not None and self._writes:
            if self.writer is None:
                self._open_writer()
            try:
                self._write(report.step, report.values)
                self._steps_written += 1
            except OSError:
                # Keras calls no on_train_end after an error: close the file here.
                # It keeps every block written before; the error says what failed.
                with contextlib.suppress(OSError):
                    self.close()
                raise
        self._epoch_position += report.batch_size

    def close(self) -> None:
        """Writes what is buffered and closes the file; for a private model, then
        writes the privacy spent (`PrivacyAccountant`) into its root attributes."""
        was_open = self.writer is not None
        super().close()
        if was_open:
            write_privacy_spent(self.model, self.path)

    def _close_after_error(self) -> None:
        """Closes the file after a fit that raised. A file this fit created that holds
        no step (the fit was refused before its first step: a loss reduction, `add_loss`,
        an unsupported option) is removed with the checkpoints this fit saved, so the
        corrected fit can write the same path; a file that existed before is kept."""
        append, overwrite = self.append, self.overwrite
        empty = self.writer is not None and self._created_file and not self._steps_written
        self.close()
        if not empty:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        for path in self._saved_checkpoints:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._saved_checkpoints:
            with contextlib.suppress(OSError):  # only when empty
                self._saved_checkpoints[0].parent.rmdir()
        # The next fit with this logger makes the file anew, with the flags given.
        self.append, self.overwrite = append, overwrite

    # -- writing --------------------------------------------------------------

    def _open_writer(self) -> None:
        layer_names = self.model.tracked_layer_names
        width = len(layer_names)

        def columns(per_example: bool) -> dict[str, int | None]:
            return {
                s.name: (width if s.per_layer else None)
                for s in self.statistics
                if s.per_example == per_example
            }

        per_step = {**columns(False), LEARNING_RATE: None}
        per_example = columns(True)
        target_ids = ()
        if self.targets is not None:
            target_ids = tuple(self.targets.example_ids)
            per_example[TARGET_INFLUENCE] = len(target_ids)
        sketch = None
        if self.sketch is not None:
            paths, widths = zip(*self.sketch.widths(self.model))
            sketch = SketchLayout(self.sketch.dim, self.sketch.seed, paths, widths)
            per_example[GRADIENT_SKETCH] = sum(widths)
        if self._checkpoints and self.overwrite:
            remove_checkpoints(self.path)
        self._created_file = self.overwrite or not os.path.exists(self.path)

        self.writer = LogWriter(
            self.path,
            layer_names=layer_names,
            per_example=per_example,
            per_step=per_step,
            target_ids=target_ids,
            sketch=sketch,
            attrs={
                **log_attrs(self.model),
                **privacy_of(self.model)[1],
            },
            overwrite=self.overwrite,
            append=self.append,
            flush_every=self.flush_every,
            flush_seconds=self.flush_seconds,
            compression=self.compression,
            # The block's compression and write run beside the next training steps.
            background=True,
        )
        # The writer numbers the steps on from the file's last one when appending.
        self.writer.open()

    def _write(self, step: int, values: Any) -> None:
        assert self.writer is not None
        batch_size = int(values[BATCH_SIZE])
        # The ids as given (int64, exact), or else the examples' positions in the epoch.
        example_ids = values.get(EXAMPLE_ID)
        if example_ids is None:
            example_ids = self._epoch_position + np.arange(batch_size, dtype=np.int64)
        # On JAX the values stay on the device (`DeviceRows`) until their block is written.
        per_example = {s.name: deferred(values, s.name) for s in self.statistics if s.per_example}
        if self.targets is not None:
            # TracIn's term of this step: the products times the rate the step used.
            per_example[TARGET_INFLUENCE] = ScaledRows(
                deferred(values, self.targets.key), deferred(values, LEARNING_RATE)
            )
        if self.sketch is not None:
            per_example[GRADIENT_SKETCH] = deferred(values, self.sketch.key)
        self.writer.write_step(
            step=step,
            epoch=self._epoch,
            example_ids=example_ids,
            per_example=per_example,
            per_step={
                LEARNING_RATE: deferred(values, LEARNING_RATE),
                **{s.name: deferred(values, s.name) for s in self.statistics if not s.per_example},
            },
            # The compiled step made these rows to the layout, and its arrays are
            # read-only: they are copied, checked (and on JAX fetched) on the writer's
            # thread, with their block (the first step of each file at once).
            checked=False,
        )
