"""Per-example scores from a log: TracIn self-influence, opposition to the batch, the mean of
any logged per-example statistic, detection."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from keras_gradtrack.analysis.tables import (
    import_optional,
    per_example_column,
    per_example_learning_rate,
)
from keras_gradtrack.io.schema import PER_EXAMPLE_GROUP

if TYPE_CHECKING:
    import pandas

    from keras_gradtrack.io.reader import LogReader


@dataclasses.dataclass(frozen=True)
class ExampleScores:
    """One score per example id, as returned by the rankings.

    Attributes:
        name: what the score is (`"self_influence"`, `"frac_negative_cosine"`).
        example_id: int64 array (n,): the ids.
        score: float64 array (n,): the score of each id.
        rows: int64 array (n,): how many logged rows (steps) the score is made of.

    Example:

    ```python
    scores = log.self_influence()  # every example, ordered by id
    top = scores.top(10)  # the 10 highest, highest first
    dict(zip(top.example_id, top.score))
    ```
    """

    name: str
    example_id: np.ndarray
    score: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.example_id)

    def top(self, k: int) -> ExampleScores:
        """The `k` highest scores, highest first (ties: smaller id first; NaN last).

        Example:

        ```python
        log.self_influence().top(5).example_id
        ```
        """
        return self._first(k, -self.score)

    def bottom(self, k: int) -> ExampleScores:
        """The `k` lowest scores, lowest first (ties: smaller id first; NaN last).

        Example:

        ```python
        log.mean_by_example("cosine").bottom(5).example_id  # most against the batch
        ```
        """
        return self._first(k, self.score)

    def _first(self, k: int, key: np.ndarray) -> ExampleScores:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"Expected k to be a positive integer. Received: k={k!r}")
        order = np.lexsort((self.example_id, np.isnan(self.score), key))[:k]
        return ExampleScores(self.name, self.example_id[order], self.score[order], self.rows[order])

    def to_pandas(self) -> pandas.DataFrame:
        """A DataFrame with the columns `example_id`, the score's name and `rows`.

        Example:

        ```python
        log.most_influential(20).to_pandas()
        ```
        """
        pandas = import_optional("pandas", "ExampleScores.to_pandas()", "pandas")
        columns = {"example_id": self.example_id, self.name: self.score, "rows": self.rows}
        return pandas.DataFrame(columns)


@dataclasses.dataclass(frozen=True)
class DetectionMetrics:
    """How well a score ranks known positives (e.g. flipped labels) first.

    Attributes:
        roc_auc: probability that a random positive scores above a random negative
            (ties count half); NaN without positives or without negatives.
        precision: fraction of the top `k` that are positives.
        recall: fraction of all positives that are in the top `k`.
        k: size of the top (`top_fraction` of the examples, at least 1).
        positives: number of positives among the scored examples.
        examples: number of scored examples.
    """

    roc_auc: float
    precision: float
    recall: float
    k: int
    positives: int
    examples: int

    def __str__(self) -> str:
        return (
            f"ROC AUC {self.roc_auc:.3f}; top {self.k} of {self.examples}: precision "
            f"{self.precision:.0%}, recall {self.recall:.0%} ({self.positives} positives)"
        )


def self_influence(log: LogReader, learning_rate: float | None = None) -> ExampleScores:
    """TracIn self-influence: `sum over logged steps t of lr_t * ||g_i,t||^2`, per id.

    The learning rate of each step is read from `/per_step/learning_rate` (joined to
    the per-example rows by step); rows whose step has no per-step row yet are left
    out. TracIn (Pruthi et al. 2020) sums over checkpoints of plain SGD; with other
    optimizers it remains a useful ranking. A high self-influence marks an example
    the model keeps failing to fit: often a mislabeled one.

    Args:
        log: the log; it needs `grad_norm`.
        learning_rate: a constant rate to use instead of the logged one (needed for
            logs without `/per_step/learning_rate`; `1.0` gives the plain sum of
            squared gradient norms).

    Returns:
        `ExampleScores` named `"self_influence"`, one per id, ordered by id.

    Example:

    ```python
    scores = log.self_influence()
    scores.top(10).example_id  # the 10 most self-influential examples
    ```
    """
    squared_norms = per_example_column(log, "grad_norm").astype(np.float64) ** 2
    if learning_rate is None:
        rates = per_example_learning_rate(log)
    else:
        rates = np.full(squared_norms.shape, float(learning_rate))
    return _sum_by_id(log, "self_influence", rates * squared_norms, kept=~np.isnan(rates))


def most_influential(
    log: LogReader, k: int = 10, learning_rate: float | None = None
) -> ExampleScores:
    """The `k` examples of highest self-influence, highest first: the suspicious ones.

    Example:

    ```python
    top = log.most_influential(20)
    for example_id, score in zip(top.example_id, top.score):
        print(example_id, score)
    ```
    """
    return self_influence(log, learning_rate).top(k)


def negative_cosine_frequency(log: LogReader) -> ExampleScores:
    """Per id, the fraction of its logged steps with `cosine < 0` (it opposed the batch).

    NaN cosines (a zero gradient) count as rows but not as negative.

    Returns:
        `ExampleScores` named `"frac_negative_cosine"`, one per id, ordered by id.

    Example:

    ```python
    log.negative_cosine_frequency().top(10)  # most often against the batch gradient
    ```
    """
    negative = (per_example_column(log, "cosine") < 0).astype(np.float64)
    counts = _sum_by_id(log, "frac_negative_cosine", negative, kept=np.ones(negative.shape, bool))
    return dataclasses.replace(counts, score=counts.score / np.maximum(counts.rows, 1))


def most_opposing(log: LogReader, k: int = 10) -> ExampleScores:
    """The `k` examples whose gradient most often points against the batch gradient.

    Example:

    ```python
    log.most_opposing(10).example_id
    ```
    """
    return negative_cosine_frequency(log).top(k)


def rankable_statistics(log: LogReader) -> list[str]:
    """The per-example statistics of `log` with one value per row (not per layer)."""
    return [name for name, width in log.layout.widths(PER_EXAMPLE_GROUP).items() if width is None]


def lowest_first(statistic: str) -> bool:
    """Whether a ranking by `statistic` puts low values first: cosines (an example
    against the batch gradient is the suspicious one); every other statistic (loss,
    grad_norm, ...) puts high values first."""
    return statistic.endswith("cosine")


def mean_by_example(log: LogReader, statistic: str) -> ExampleScores:
    """Per id, the mean of a per-example statistic over its logged rows (NaN rows left out).

    Args:
        log: the log.
        statistic: a per-example statistic with one value per row: `"loss"`,
            `"grad_norm"`, `"cosine"`, ... (`rankable_statistics(log)` lists them).

    Returns:
        `ExampleScores` named `"mean_<statistic>"`, one per id, ordered by id; `rows`
        counts the rows averaged (an id whose every value is NaN scores NaN, 0 rows).

    Raises:
        ValueError: for a statistic the log does not hold per example and row; the
            message lists those it holds.

    Example:

    ```python
    log.mean_by_example("loss").top(10)  # highest mean loss: often mislabeled
    ```
    """
    available = rankable_statistics(log)
    if statistic not in available:
        raise ValueError(
            f"Cannot rank by {statistic!r}: '{log.path}' holds no per-example statistic of "
            f"that name with one value per row. Available: {available}"
        )
    values = log.per_example(statistic).astype(np.float64)
    kept = ~np.isnan(values)
    ids, inverse = np.unique(log.per_example("example_id"), return_inverse=True)
    total = np.bincount(inverse[kept], weights=values[kept], minlength=len(ids))
    rows = np.bincount(inverse[kept], minlength=len(ids)).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(rows > 0, total / np.maximum(rows, 1), np.nan)
    return ExampleScores(f"mean_{statistic}", ids.astype(np.int64), mean, rows)


def rank_by(log: LogReader, statistic: str, k: int = 10, reverse: bool = False) -> ExampleScores:
    """The `k` examples ranked first by their mean `statistic` over the run.

    High mean first for `loss`, `grad_norm` and every statistic but cosines; low (most
    negative) mean first for `cosine`; `reverse=True` turns the order around.

    Example:

    ```python
    log.rank_by("loss", 20).example_id  # the 20 examples of highest mean loss
    log.rank_by("cosine", 20)  # lowest mean cosine first
    ```
    """
    scores = mean_by_example(log, statistic)
    return scores.bottom(k) if lowest_first(statistic) != reverse else scores.top(k)


def detection_metrics(
    scores: ExampleScores, positive_ids: Iterable[int], top_fraction: float = 0.1
) -> DetectionMetrics:
    """ROC AUC and precision / recall in the top `top_fraction` of a ranking.

    Args:
        scores: e.g. `log.self_influence()`: higher means "more likely positive".
        positive_ids: the ids known to be positive (e.g. the flipped labels).
        top_fraction: size of the top, as a fraction of the scored examples.

    Example:

    ```python
    metrics = detection_metrics(log.self_influence(), np.flatnonzero(flipped))
    print(metrics.roc_auc, metrics.recall)
    ```
    """
    if not 0 < top_fraction <= 1:
        raise ValueError(f"Expected 0 < top_fraction <= 1. Received: {top_fraction=}")
    positive = np.isin(scores.example_id, np.fromiter(positive_ids, dtype=np.int64))
    count, positives = len(scores), int(positive.sum())
    k = max(1, int(np.floor(top_fraction * count + 1e-9)))
    hits = int(np.isin(scores.top(k).example_id, scores.example_id[positive]).sum())
    auc = float("nan")
    if 0 < positives < count:
        # Mann-Whitney U from average ranks, so that ties count half; NaN ranks lowest.
        values = np.where(np.isnan(scores.score), -np.inf, scores.score)
        _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
        average_rank = np.cumsum(counts) - (counts - 1) / 2.0
        rank_sum = average_rank[inverse][positive].sum()
        auc = (rank_sum - positives * (positives + 1) / 2) / (positives * (count - positives))
    recall = hits / positives if positives else float("nan")
    return DetectionMetrics(float(auc), hits / k, recall, k, positives, count)


def _sum_by_id(log: LogReader, name: str, values: np.ndarray, kept: np.ndarray) -> ExampleScores:
    ids, inverse = np.unique(log.per_example("example_id")[kept], return_inverse=True)
    total = np.bincount(inverse, weights=values[kept], minlength=len(ids))
    rows = np.bincount(inverse, minlength=len(ids)).astype(np.int64)
    return ExampleScores(name, ids.astype(np.int64), total, rows)
