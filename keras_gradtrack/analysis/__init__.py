"""Afterwards analysis of a gradient log: histories, influence rankings, summaries, export.

The analyses of one log are methods of `GradientLog` (`log.summary()`,
`log.most_influential(10)`, `log.to_csv(...)`, ...): one API for each. The functions
here are those that are not about one log alone (detection metrics against known
labels, text tables) or that take arguments a method would hide. Only numpy is
needed; pandas and pyarrow are imported when asked for.

Example:

```python
import keras_gradtrack as kgt

log = kgt.GradientLog("run.h5")
suspicious = log.most_influential(20)  # highest TracIn self-influence first
log.rank_by("loss", 20)  # highest mean loss first (any per-example statistic)
log.influence().opponents(target_id=3)  # with targets: who pushed against target 3
print(suspicious.example_id, suspicious.score)
print(log.summary())
log.to_csv("run.per_example.csv")
```
"""

from keras_gradtrack.analysis.influence import Influence, influence_from_sketches
from keras_gradtrack.analysis.log import GradientLog
from keras_gradtrack.analysis.scores import (
    DetectionMetrics,
    ExampleScores,
    detection_metrics,
    mean_by_example,
    rank_by,
)
from keras_gradtrack.analysis.tables import (
    LayerSummary,
    per_example_learning_rate,
    step_quantiles,
    table_columns,
)
from keras_gradtrack.analysis.text import text_table

__all__ = [
    "DetectionMetrics",
    "ExampleScores",
    "GradientLog",
    "Influence",
    "LayerSummary",
    "detection_metrics",
    "influence_from_sketches",
    "mean_by_example",
    "per_example_learning_rate",
    "rank_by",
    "step_quantiles",
    "table_columns",
    "text_table",
]
