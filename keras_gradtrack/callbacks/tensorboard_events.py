"""Gradient statistics as TensorBoard event files: one step's summaries, and a whole log.

The same `StepSummaryWriter` serves `TensorBoardGradientLogger` during `fit` and
`write_tensorboard` afterwards, so both write the same tags from the same numbers:

| tag | kind | value at step s |
| --- | --- | --- |
| `<stat>` (e.g. `gradient_diversity`, `learning_rate`) | scalar | the per-step column |
| `<stat>/<layer>` | scalar | a per-layer per-step column |
| `<stat>_mean` (e.g. `grad_norm_mean`) | scalar | mean of the step's finite per-example values |
| `<stat>_mean/<layer>` (e.g. `layer_grad_norm_mean/dense`) | scalar | the same, one layer |
| `<stat>` (e.g. `grad_norm`, `cosine`, `loss`) | histogram | the step's finite per-example values |
| `<stat>/<layer>` (e.g. `layer_grad_norm/dense`) | histogram | the same, one layer |

A step's values are TensorBoard's own scalar and histogram summaries (its
`scalar_pb` and `histogram_pb`: the buckets of `tf.summary.histogram`, computed in
numpy), written as one proto per step through `tf.summary`'s file writer: one op per
step instead of one per value (`benchmarks/logs_cost.py`). `tensorboard` is an optional extra, imported on
first use, with an error naming `pip install "keras-gradtrack[tensorboard]"`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from keras_gradtrack.io import schema
from keras_gradtrack.io.reader import LogReader

DEFAULT_BUCKETS = 30
# Per-example columns that are not statistics: no histogram or mean is written for them.
NOT_SUMMARIZED = (schema.TARGET_INFLUENCE, schema.GRADIENT_SKETCH)
INSTALL_HINT = 'pip install "keras-gradtrack[tensorboard]"'


@dataclasses.dataclass(frozen=True)
class SummaryOps:
    """TensorBoard's summary protos and TensorFlow's event file writer.

    Attributes:
        create_file_writer: `tf.summary.create_file_writer`.
        write_raw_pb: `tf.summary.experimental.write_raw_pb`.
        summary: TensorBoard's `Summary` proto class.
        scalar_pb: TensorBoard's scalar summary (a `Summary` of one value).
        histogram_pb: TensorBoard's histogram summary, bucketed in numpy.
    """

    create_file_writer: Callable[..., Any]
    write_raw_pb: Callable[..., Any]
    summary: Any
    scalar_pb: Callable[..., Any]
    histogram_pb: Callable[..., Any]


def summary_ops() -> SummaryOps:
    """TensorBoard's summary ops, or an ImportError naming the extra.

    Example:

    ```python
    ops = summary_ops()
    writer = ops.create_file_writer("tb/")
    ```
    """
    try:
        import tensorboard  # noqa: F401  (first: a missing package fails here)
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.histogram.summary_v2 import histogram_pb
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
    except ImportError as error:
        raise ImportError(
            "Writing TensorBoard event files needs the tensorboard package, an optional "
            f"extra of keras-gradtrack. Install it with `{INSTALL_HINT}`."
        ) from error
    import tensorflow as tf

    return SummaryOps(
        create_file_writer=tf.summary.create_file_writer,
        write_raw_pb=tf.summary.experimental.write_raw_pb,
        summary=Summary,
        scalar_pb=scalar_pb,
        histogram_pb=histogram_pb,
    )


def prepare_logdir(logdir: str | os.PathLike[str]) -> str:
    """Creates `logdir` if needed and checks that files can be written in it.

    Raises:
        NotADirectoryError: when `logdir` or a parent of it is a file.
        PermissionError: when it cannot be created or written.

    Example:

    ```python
    prepare_logdir("tb/run_1")
    ```
    """
    path = Path(logdir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        files = [p for p in (path, *path.parents) if p.exists() and not p.is_dir()]
        blocker = files[0] if files else error.filename
        raise NotADirectoryError(
            f"Expected a directory for the TensorBoard event files. Received: logdir="
            f"'{logdir}', where '{blocker}' is a file."
        ) from error
    except PermissionError as error:
        raise PermissionError(
            f"Cannot create the TensorBoard logdir '{logdir}': permission denied "
            f"('{error.filename}')."
        ) from error
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise PermissionError(
            f"Cannot write event files in the TensorBoard logdir '{logdir}': {error.strerror}."
        ) from error
    return os.fspath(path)


def _finite_values(values: np.ndarray) -> np.ndarray:
    """The finite entries of `values` as float64 (a cosine is NaN where a norm is 0)."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    return values[np.isfinite(values)]


class StepSummaryWriter:
    """Writes the summaries of tracked steps to one TensorBoard event file.

    Args:
        logdir: The directory of the event file (created if needed).
        layer_names: The L layer names of the per-layer columns, used in the tags.
        buckets: Histogram buckets (TensorBoard's default is 30).

    Raises:
        ImportError: without the `tensorboard` package.
        NotADirectoryError, PermissionError: for a logdir that cannot be written.

    Example:

    ```python
    writer = StepSummaryWriter("tb/", layer_names=["dense", "logits"])
    writer.write_step(
        7,
        per_step={"gradient_diversity": np.float32(1.8)},
        per_example={
            "grad_norm": np.array([0.5, 2.0]),  # two examples
            "layer_grad_norm": np.array([[0.3, 0.4], [1.2, 1.6]]),  # (examples, layers)
        },
    )
    writer.close()
    ```
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        layer_names: Sequence[str],
        buckets: int = DEFAULT_BUCKETS,
    ):
        if not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"Expected `buckets` to be a positive int. Received: {buckets!r}")
        self._ops = summary_ops()
        self.logdir = prepare_logdir(logdir)
        self.layer_names = list(layer_names)
        self.buckets = buckets
        self._writer: Any = self._ops.create_file_writer(self.logdir)

    def write_step(
        self,
        step: int,
        per_step: Mapping[str, Any],
        per_example: Mapping[str, Any],
        histograms: bool = True,
    ) -> None:
        """Writes one step: its scalars, and (with `histograms`) its per-example histograms.

        Args:
            step: The TensorBoard step: the log's step number.
            per_step: Per-step columns: a scalar each, or L values (one per layer).
            per_example: Per-example columns of the step's examples: (B,) or (B, L).
            histograms: Whether to write the histograms of this step.
        """
        if self._writer is None:
            raise ValueError(f"The StepSummaryWriter of '{self.logdir}' is closed.")
        ops = self._ops
        # One Summary proto of all the step's values, written in one op: an op per
        # value costs more than the values' encoding in eager mode.
        summary = ops.summary()
        for name, value in per_step.items():
            value = np.asarray(value, dtype=np.float64)
            for tag, column in self._columns(name, value, per_layer=value.ndim == 1):
                summary.value.extend(ops.scalar_pb(tag, float(column)).value)
        for name, value in per_example.items():
            if name in NOT_SUMMARIZED:
                continue
            value = np.asarray(value)
            # (B,) is one column; (B, L) one per layer (layers first for `_columns`).
            for tag, column in self._columns(name, value.T, per_layer=value.ndim == 2):
                finite = _finite_values(column)
                mean = float(finite.mean()) if finite.size else float("nan")
                summary.value.extend(ops.scalar_pb(_mean_tag(tag), mean).value)
                if histograms and finite.size:
                    summary.value.extend(ops.histogram_pb(tag, finite, self.buckets).value)
        with self._writer.as_default():
            ops.write_raw_pb(summary.SerializeToString(), step=int(step))

    def flush(self) -> None:
        """Writes buffered events to the file."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file (idempotent)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def _columns(
        self, name: str, value: np.ndarray, per_layer: bool
    ) -> list[tuple[str, np.ndarray]]:
        """(tag, values) of each column: `value` itself, or each layer's `value[k]`."""
        if not per_layer:
            return [(name, value)]
        if len(value) != len(self.layer_names):
            raise ValueError(
                f"Expected {len(self.layer_names)} columns of {name!r}, one per layer "
                f"{self.layer_names}. Received: {len(value)}"
            )
        return [(f"{name}/{layer}", column) for layer, column in zip(self.layer_names, value)]


def _mean_tag(tag: str) -> str:
    name, _, layer = tag.partition("/")
    return f"{name}_mean/{layer}" if layer else f"{name}_mean"


def write_tensorboard(
    log: str | os.PathLike[str] | LogReader,
    logdir: str | os.PathLike[str],
    histogram_every: int = 1,
    buckets: int = DEFAULT_BUCKETS,
) -> str:
    """Writes TensorBoard event files of a gradient log, after the fact.

    Every logged step becomes a TensorBoard step with the log's own step number:
    scalars for every per-step column (`gradient_diversity`, `noise_scale`,
    `batch_grad_norm`, `mean_cosine`, `frac_negative_cosine`, `learning_rate`, ...)
    and the means of the per-example columns over the step's examples
    (`grad_norm_mean`, `layer_grad_norm_mean/<layer>`, ...); histograms of the
    step's per-example values (`grad_norm`, `cosine`, `loss`,
    `layer_grad_norm/<layer>`, ...) every `histogram_every` logged steps. These are
    the tags `TensorBoardGradientLogger` writes during `fit`. Non-finite values (a
    cosine is NaN where a norm is 0) are left out of histograms and means.

    Args:
        log: The `.h5` log (a path, or an open `LogReader` / `GradientLog`).
        logdir: The directory to write the event file in (created if needed); open
            it with `tensorboard --logdir <logdir>`.
        histogram_every: Write histograms for one logged step in every this many
            (the first logged step always has them).
        buckets: Buckets per histogram.

    Returns:
        The logdir.

    Raises:
        FileNotFoundError, ValueError, OSError: for a missing, foreign or damaged log.
        NotADirectoryError, PermissionError: for a logdir that cannot be written.
        ImportError: without the `tensorboard` package.

    Example:

    ```python
    kgt.write_tensorboard("run.h5", "tb/run")
    # then: tensorboard --logdir tb/
    ```
    """
    if not isinstance(histogram_every, int) or histogram_every < 1:
        raise ValueError(
            f"Expected `histogram_every` to be a positive int. Received: {histogram_every!r}"
        )
    if isinstance(log, LogReader):
        return _write_log(log, logdir, histogram_every, buckets)
    with LogReader(log) as reader:
        return _write_log(reader, logdir, histogram_every, buckets)


def _write_log(reader: LogReader, logdir: Any, histogram_every: int, buckets: int) -> str:
    layout = reader.layout
    writer = StepSummaryWriter(logdir, reader.layers, buckets=buckets)
    try:
        step_names = list(layout.widths(schema.PER_STEP_GROUP))
        example_names = [
            name for name in layout.widths(schema.PER_EXAMPLE_GROUP) if name not in NOT_SUMMARIZED
        ]
        per_step = {name: reader.per_step(name) for name in step_names}
        per_example = {name: reader.per_example(name) for name in example_names}
        example_steps = reader.per_example(schema.STEP)
        # Rows are appended step by step; a stable sort keeps each step's rows in order.
        order = np.argsort(example_steps, kind="stable")
        sorted_steps = example_steps[order]
        for index, step in enumerate(reader.per_step(schema.STEP)):
            rows = order[
                np.searchsorted(sorted_steps, step, "left") : np.searchsorted(
                    sorted_steps, step, "right"
                )
            ]
            writer.write_step(
                int(step),
                per_step={name: values[index] for name, values in per_step.items()},
                per_example={name: values[rows] for name, values in per_example.items()},
                histograms=index % histogram_every == 0,
            )
    finally:
        writer.close()
    return writer.logdir
