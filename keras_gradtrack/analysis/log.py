"""`GradientLog`: the reader of a gradient log, with the analyses as methods."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from keras_gradtrack.analysis.influence import (
    Influence,
    influence,
    require_sketches,
    sketched_influence,
)
from keras_gradtrack.analysis.scores import (
    ExampleScores,
    most_influential,
    most_opposing,
    negative_cosine_frequency,
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
        path: path of the log file.

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: if the file is not a keras_gradtrack log, or was written with an
            unsupported schema version.
        OSError: if the file is damaged (cut short, or overwritten in part).

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

    def influence(self, targets: Any = None, model: Any = None) -> Influence:
        """TracIn scores of every training example on targets (`analysis.influence`).

        Without arguments, the exact scores of the targets the log was written
        with (`HDF5GradientLogger(targets=...)`). For targets chosen after
        training, pass them with a model of the log's architecture: the scores
        are then estimated from the log's gradient sketches and checkpoints
        (`HDF5GradientLogger(sketch_dim=...)`; this needs TensorFlow, and the
        model's weights are put back afterwards).

        Args:
            targets: `(x, y)` of the targets; a dict `x` may hold `"example_id"`.
            model: The model, with the architecture the log was written with.

        Raises:
            KeyError: if the log has no targets (without arguments) or no
                sketches (with them).
            ValueError: for only one of `targets` and `model`, a model of another
                architecture, or a log without checkpoints.

        Example:

        ```python
        influence = log.influence()
        influence.opponents(target_id=7, k=10).example_id
        later = log.influence(targets=(x_test[:5], y_test[:5]), model=model)
        ```
        """
        if targets is None and model is None:
            return influence(self)
        if targets is None or model is None:
            raise ValueError(
                "Pass both targets=(x, y) and model= for targets chosen after training, or "
                f"neither. Received: targets={type(targets).__name__}, "
                f"model={type(model).__name__}"
            )
        require_sketches(self)
        # TensorFlow is imported for this estimate only; reading needs none.
        from keras_gradtrack.engine.sketches import checkpoint_sketches
        from keras_gradtrack.engine.targets import TargetSet

        target_set = TargetSet.from_argument(targets)
        assert self.layout.sketch is not None
        sketches = checkpoint_sketches(model, self.layout.sketch, self.checkpoints(), target_set)
        return sketched_influence(self, sketches, target_set.example_ids)

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
