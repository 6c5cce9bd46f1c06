"""Afterwards analysis of a gradient log: histories, influence rankings, summaries, export.

Every function takes an open log (`GradientLog`, or the plain
`keras_gradtrack.io.LogReader`), and most are also methods of `GradientLog`
(`log.most_influential(10)` calls `most_influential(log, 10)`). Only numpy is
needed; pandas and pyarrow are imported when asked for.

Example:

```python
import keras_gradtrack as kgt

log = kgt.GradientLog("run.h5")
suspicious = log.most_influential(20)  # highest TracIn self-influence first
log.influence().opponents(target_id=3)  # with targets: who pushed against target 3
print(suspicious.example_id, suspicious.score)
print(log.summary())
log.to_csv("run.per_example.csv")
```
"""

from keras_gradtrack.analysis.influence import Influence, influence, influence_from_sketches
from keras_gradtrack.analysis.log import GradientLog
from keras_gradtrack.analysis.scores import (
    DetectionMetrics,
    ExampleScores,
    detection_metrics,
    most_influential,
    most_opposing,
    negative_cosine_frequency,
    self_influence,
)
from keras_gradtrack.analysis.tables import (
    LayerSummary,
    example_history,
    layer_summary,
    per_example_learning_rate,
    step_quantiles,
    table_columns,
    to_csv,
    to_parquet,
)
from keras_gradtrack.analysis.text import summary, text_table

__all__ = [
    "DetectionMetrics",
    "ExampleScores",
    "GradientLog",
    "Influence",
    "LayerSummary",
    "detection_metrics",
    "example_history",
    "influence",
    "influence_from_sketches",
    "layer_summary",
    "most_influential",
    "most_opposing",
    "negative_cosine_frequency",
    "per_example_learning_rate",
    "self_influence",
    "step_quantiles",
    "summary",
    "table_columns",
    "text_table",
    "to_csv",
    "to_parquet",
]
