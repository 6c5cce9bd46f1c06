"""Which training examples pushed the model toward (or away from) its output on a target.

TracIn (Pruthi et al. 2020): `influence(i, j) = sum over the logged steps that
trained on example i of lr_t <g_i(theta_t), g_target_j(theta_t)>`. A positive
score makes i a *proponent* of target j (training on i lowered j's loss, to first
order), a negative one an *opponent*. `influence` sums the exact products the
logger wrote for targets given before training; `influence_from_sketches`
estimates them from gradient sketches for targets chosen afterwards (the targets'
sketches at the checkpoints come from `keras_gradtrack.attribution`, which runs
the model on the backend Keras runs on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from keras_gradtrack.analysis.scores import ExampleScores
from keras_gradtrack.analysis.tables import import_optional, per_example_learning_rate
from keras_gradtrack.io.schema import GRADIENT_SKETCH, PER_EXAMPLE_GROUP, TARGET_INFLUENCE

if TYPE_CHECKING:
    import pandas

    from keras_gradtrack.io.reader import LogReader

# Rows read at a time: memory stays bounded by a block, whatever the log's length.
BLOCK_ROWS = 65536


@dataclasses.dataclass(frozen=True)
class Influence:
    """TracIn scores of every logged training example on every target.

    Attributes:
        train_ids: int64 (n_train,): the training examples' ids, ascending.
        target_ids: int64 (n_targets,): the targets' ids, in the log's order.
        scores: float64 (n_train, n_targets): `scores[i, j]`, the sum over the
            logged steps that trained on `train_ids[i]` of `lr_t <g_i, g_target_j>`.
        rows: int64 (n_train,): how many logged rows (steps) each score sums.
        method: `"exact"`, or how the scores were estimated.

    Example:

    ```python
    influence = log.influence()
    influence.proponents(target_id=3, k=10).example_id  # pushed toward target 3's label
    influence.opponents(target_id=3, k=10).example_id  # pushed away from it
    ```
    """

    train_ids: np.ndarray
    target_ids: np.ndarray
    scores: np.ndarray
    rows: np.ndarray
    method: str = "exact"

    def on(self, target_id: int) -> ExampleScores:
        """Every training example's score on one target, ordered by training id.

        Raises:
            KeyError: for an id that is not one of the targets.
        """
        matches = np.flatnonzero(self.target_ids == target_id)
        if len(matches) != 1:
            shown = self.target_ids[:20].tolist()
            more = ", ..." if len(self.target_ids) > 20 else ""
            raise KeyError(
                f"Expected one of the target ids {shown}{more}. Received: target_id={target_id!r}"
            )
        column = self.scores[:, matches[0]]
        return ExampleScores("influence", self.train_ids, column, self.rows)

    def proponents(self, target_id: int, k: int = 10) -> ExampleScores:
        """The `k` training examples of highest score on a target, highest first.

        Example:

        ```python
        top = influence.proponents(target_id=3, k=5)
        dict(zip(top.example_id, top.score))
        ```
        """
        return self.on(target_id).top(k)

    def opponents(self, target_id: int, k: int = 10) -> ExampleScores:
        """The `k` training examples of lowest (most negative) score, lowest first.

        Example:

        ```python
        influence.opponents(target_id=3, k=5).score  # negative: they raised its loss
        ```
        """
        column = self.on(target_id)
        negated = dataclasses.replace(column, score=-column.score).top(k)
        return dataclasses.replace(negated, score=-negated.score)

    def to_pandas(self) -> pandas.DataFrame:
        """The scores as a DataFrame: index the training ids, one column per target id.

        Example:

        ```python
        frame = influence.to_pandas()
        frame[3].nlargest(10)  # the proponents of target 3
        ```
        """
        pandas = import_optional("pandas", "Influence.to_pandas()", "pandas")
        index = pandas.Index(self.train_ids, name="example_id")
        columns = pandas.Index(self.target_ids, name="target_id")
        return pandas.DataFrame(self.scores, index=index, columns=columns)


def influence(log: LogReader) -> Influence:
    """The exact TracIn scores of the targets the log was written with.

    Sums `/per_example/target_influence` (written by `HDF5GradientLogger(targets=...)`:
    per row, `lr_t <g_i, g_target_j>` at the step's weights) by training id.

    Raises:
        KeyError: if the log has no targets.

    Example:

    ```python
    scores = influence(log).scores  # (n_train, n_targets)
    ```
    """
    if TARGET_INFLUENCE not in log.per_example_names:
        raise KeyError(
            f"'{log.path}' has no {TARGET_INFLUENCE}: it was written without targets. "
            "Pass targets=(x, y) to HDF5GradientLogger to log exact influence, or "
            "sketch_dim=... and estimate it afterwards with "
            "keras_gradtrack.attribution.estimate_influence(log, model, targets=(x, y))."
        )
    target_ids = np.asarray(log.layout.target_ids, np.int64)
    train_ids, inverse = np.unique(log.per_example("example_id"), return_inverse=True)
    scores = np.zeros((len(train_ids), len(target_ids)))
    for start in range(0, log.num_examples, BLOCK_ROWS):
        block = log.read(PER_EXAMPLE_GROUP, TARGET_INFLUENCE, start, start + BLOCK_ROWS)
        _add_by_row(scores, inverse[start : start + len(block)], block)
    rows = np.bincount(inverse, minlength=len(train_ids)).astype(np.int64)
    return Influence(train_ids.astype(np.int64), target_ids, scores, rows)


def influence_from_sketches(
    log: LogReader, target_sketches: Mapping[int, np.ndarray], target_ids: np.ndarray
) -> Influence:
    """TracIn scores estimated from the log's gradient sketches.

    Each row's sketch (of `g_i` at its step t) is paired with the targets' sketches
    at the last checkpoint at or before t (the first checkpoint for rows before
    it): `lr_t <sketch_i, sketch_target_j(checkpoint)>`.

    Args:
        log: a log with `/per_example/gradient_sketch` (`sketch_dim=`).
        target_sketches: `{checkpoint step: (n_targets, K) sketches}`.
        target_ids: the targets' ids, in the sketches' row order.

    Raises:
        KeyError: if the log has no sketches.
        ValueError: without target sketches, or of another width than the log's.

    Example:

    ```python
    estimate = influence_from_sketches(log, sketches, np.arange(5))
    ```
    """
    require_sketches(log)
    width = log.layout.widths(PER_EXAMPLE_GROUP)[GRADIENT_SKETCH]
    shapes = {np.shape(s) for s in target_sketches.values()}
    if not target_sketches or shapes != {(len(target_ids), width)}:
        raise ValueError(
            f"Expected target sketches of shape ({len(target_ids)}, {width}) for at least "
            f"one checkpoint. Received shapes: {sorted(shapes)}"
        )
    steps = np.array(sorted(target_sketches), np.int64)
    stacked = np.stack([np.asarray(target_sketches[s], np.float64) for s in steps])
    train_ids, inverse = np.unique(log.per_example("example_id"), return_inverse=True)
    row_steps = log.per_example("step")
    rates = per_example_learning_rate(log)
    scores = np.zeros((len(train_ids), len(target_ids)))
    for start in range(0, log.num_examples, BLOCK_ROWS):
        block = log.read(PER_EXAMPLE_GROUP, GRADIENT_SKETCH, start, start + BLOCK_ROWS)
        stop = start + len(block)
        checkpoint = np.searchsorted(steps, row_steps[start:stop], side="right") - 1
        checkpoint = np.maximum(checkpoint, 0)
        products = np.empty((len(block), len(target_ids)))
        for c in np.unique(checkpoint):
            rows_of_c = checkpoint == c
            products[rows_of_c] = block[rows_of_c].astype(np.float64) @ stacked[c].T
        products *= rates[start:stop, None]
        kept = ~np.isnan(rates[start:stop])
        _add_by_row(scores, inverse[start:stop][kept], products[kept])
    rows = np.bincount(inverse, minlength=len(train_ids)).astype(np.int64)
    method = f"sketch (dim {log.layout.sketch.dim}, {len(steps)} checkpoints)"
    return Influence(train_ids.astype(np.int64), np.asarray(target_ids), scores, rows, method)


def require_sketches(log: LogReader) -> None:
    """Raises a `KeyError` unless the log holds gradient sketches."""
    if GRADIENT_SKETCH not in log.per_example_names or log.layout.sketch is None:
        raise KeyError(
            f"'{log.path}' has no {GRADIENT_SKETCH}: it was written without sketch_dim "
            "(HDF5GradientLogger(sketch_dim=...) writes gradient sketches and checkpoints)."
        )


def _add_by_row(total: np.ndarray, positions: np.ndarray, block: np.ndarray) -> None:
    """`total[positions[r]] += block[r]` for every row r, repeated positions summed."""
    if not len(positions):
        return
    order = np.argsort(positions, kind="stable")
    distinct, starts = np.unique(positions[order], return_index=True)
    total[distinct] += np.add.reduceat(block[order].astype(np.float64), starts, axis=0)
