"""`GradientLog`: the reader of a gradient log, with the analyses as methods."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from keras_gradtrack.analysis.influence import Influence, influence
from keras_gradtrack.analysis.scores import (
    ExampleScores,
    mean_by_example,
    most_influential,
    most_opposing,
    negative_cosine_frequency,
    rank_by,
    rankable_statistics,
    self_influence,
)
from keras_gradtrack.analysis.tables import (
    LayerSummary,
    example_history,
    layer_summary,
    to_csv,
    to_parquet,
)
from keras_gradtrack.analysis.text import summary
from keras_gradtrack.io.checkpoints import checkpoints
from keras_gradtrack.io.reader import LogReader


class GradientLog(LogReader):
    """Read access to a keras_gradtrack HDF5 log, with its analyses.

    Everything `keras_gradtrack.io.LogReader` reads (columns as numpy arrays,
    `to_pandas`, live reading with `refresh()`), plus summaries, influence
    rankings and export; each method calls the function of the same name in
    `keras_gradtrack.analysis` with this log. Reading needs neither TensorFlow nor
    Keras.

    Args:
        path: path of the log file, opened as `LogReader` opens it (with its errors
            for a missing, foreign or damaged file).

    Example:

    ```python
    with GradientLog("run.h5") as log:
        cosine = log.per_example("cosine")  # (N,): one value per example seen
        print(log.summary())
        log.most_influential(20).example_id  # highest TracIn self-influence first
    ```
    """

    def summary(self) -> str:
        """A plain-text summary: steps, examples, layers, range of every statistic.

        Example:

        ```python
        print(GradientLog("run.h5").summary())
        ```
        """
        return summary(self)

    def example_history(self, example_id: int) -> dict[str, np.ndarray]:
        """Every logged row of one example, in step order (`analysis.example_history`).

        Example:

        ```python
        log.example_history(17)["cosine"]
        ```
        """
        return example_history(self, example_id)

    def self_influence(self, learning_rate: float | None = None) -> ExampleScores:
        """TracIn self-influence per example: `sum_t lr_t ||g_i,t||^2` (`analysis.self_influence`).

        Example:

        ```python
        scores = log.self_influence()  # ExampleScores, ordered by example id
        ```
        """
        return self_influence(self, learning_rate)

    def most_influential(self, k: int = 10, learning_rate: float | None = None) -> ExampleScores:
        """The `k` examples of highest self-influence, highest first: the suspicious ones.

        Example:

        ```python
        log.most_influential(20).example_id
        ```
        """
        return most_influential(self, k, learning_rate)

    def influence(self) -> Influence:
        """Exact TracIn scores of every training example on the log's targets
        (`analysis.influence`; a log written with `HDF5GradientLogger(targets=...)`).

        For targets chosen after training, see
        `keras_gradtrack.attribution.estimate_influence`.

        Raises:
            KeyError: if the log has no targets.

        Example:

        ```python
        influence = log.influence()
        influence.opponents(target_id=7, k=10).example_id
        ```
        """
        return influence(self)

    def checkpoints(self) -> dict[int, Path]:
        """`{step: weights file}` of the checkpoints saved beside the log (`io.checkpoints`).

        Each is a Keras `.weights.h5` file of the model's weights alone (no optimizer
        state), those the step began with.

        Example:

        ```python
        model.load_weights(log.checkpoints()[100])  # Keras notes: no optimizer state
        ```
        """
        return checkpoints(self.path)

    def negative_cosine_frequency(self) -> ExampleScores:
        """Per example, the fraction of its logged steps with `cosine < 0`.

        Example:

        ```python
        log.negative_cosine_frequency().score  # ordered by example id
        ```
        """
        return negative_cosine_frequency(self)

    def most_opposing(self, k: int = 10) -> ExampleScores:
        """The `k` examples most often with `cosine < 0` (`analysis.most_opposing`).

        Example:

        ```python
        log.most_opposing(10).score  # fraction of their steps against the batch
        ```
        """
        return most_opposing(self, k)

    def mean_by_example(self, statistic: str) -> ExampleScores:
        """Per example, the mean of a per-example statistic over its logged rows
        (`analysis.mean_by_example`), ordered by id.

        Example:

        ```python
        log.mean_by_example("loss").top(10)  # highest mean loss first
        ```
        """
        return mean_by_example(self, statistic)

    def rank_by(self, statistic: str, k: int = 10, reverse: bool = False) -> ExampleScores:
        """The `k` examples ranked first by their mean `statistic` (`analysis.rank_by`):
        high first for `loss`, `grad_norm` and others, low first for `cosine`;
        `reverse=True` turns the order around.

        Raises:
            ValueError: for a statistic the log does not hold per example and row,
                listing those it holds.

        Example:

        ```python
        log.rank_by("loss", 20).example_id  # mean loss detects mislabels best
        ```
        """
        return rank_by(self, statistic, k, reverse)

    @property
    def rankable_statistics(self) -> list[str]:
        """The per-example statistics `rank_by` accepts (one value per row)."""
        return rankable_statistics(self)

    def layer_summary(
        self, statistic: str = "layer_grad_norm", by: str = "step", reduce: str = "median"
    ) -> LayerSummary:
        """A per-layer statistic reduced per step or epoch (`analysis.layer_summary`).

        Example:

        ```python
        log.layer_summary("layer_cosine", by="epoch").values  # (epochs, L)
        ```
        """
        return layer_summary(self, statistic, by, reduce)

    def to_csv(self, path: str | os.PathLike[str], kind: str = "per_example") -> str:
        """Writes one table to CSV; returns the path (`analysis.to_csv`).

        Example:

        ```python
        log.to_csv("run.per_step.csv", kind="per_step")
        ```
        """
        return to_csv(self, path, kind)

    def to_parquet(self, path: str | os.PathLike[str], kind: str = "per_example") -> str:
        """Writes one table to Parquet (needs pyarrow); returns the path (`analysis.to_parquet`).

        Example:

        ```python
        log.to_parquet("run.per_example.parquet")
        ```
        """
        return to_parquet(self, path, kind)
