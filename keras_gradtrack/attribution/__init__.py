"""Influence on targets chosen after training, from a log's gradient sketches.

Targets given before training get exact scores (`HDF5GradientLogger(targets=...)`,
read with `GradientLog.influence()`). For any other example, a log written with
`sketch_dim=` holds a sketch of every logged per-example gradient and the weights
at its checkpoints: `estimate_influence` sketches the targets at each checkpoint
(with the model, on the backend Keras runs on: the TensorFlow engine's or the JAX
engine's) and pairs them with the rows of the steps after it; `sketch_examples` returns
any examples' sketches at each checkpoint, to compare with the logged rows (cosines for
data selection).

The subpackage holds the two requests a logger makes of the tracked step
(`engine.requests.AttributionRequest`): `targets.py` (`TargetSet`, the exact
products with targets given before training) and `sketches.py` (`GradientSketch`,
and examples' sketches at a model's weights); `checkpoint_sketches.py` runs either
engine's sketches at each checkpoint, for `estimate_influence` and for
`sketch_examples` (`example_sketches.py`). Reading the scores back is
`analysis.influence`, which needs no TensorFlow.

Example:

```python
import keras_gradtrack as kgt

logger = kgt.HDF5GradientLogger("run.h5", sketch_dim=16)
model.fit(x, y, epochs=10, callbacks=[logger])
# ... later, a misprediction on x_test[3]:
estimate = kgt.attribution.estimate_influence("run.h5", model, (x_test[3:4], y_test[3:4]))
estimate.opponents(target_id=0, k=10).example_id
```
"""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_gradtrack.analysis import GradientLog, Influence
from keras_gradtrack.analysis.influence import influence_from_sketches, require_sketches
from keras_gradtrack.attribution.checkpoint_sketches import checkpoint_sketches
from keras_gradtrack.attribution.example_sketches import engine_sketch_functions, sketch_examples
from keras_gradtrack.engine.attribution_requests import TargetExamples

__all__ = ["estimate_influence", "sketch_examples"]


def estimate_influence(
    log: GradientLog | str | os.PathLike[str], model: Any, targets: Any
) -> Influence:
    """TracIn scores of every logged training example on targets chosen after training.

    Each checkpoint's weights are loaded into `model` in turn and the targets'
    gradients sketched there (compiled loss, inference mode, the log's
    projections); a logged row of step t is paired with the targets' sketches at
    the last checkpoint at or before t: `lr_t <sketch_i, sketch_target>`. The
    model's own weights are put back afterwards.

    Args:
        log: a `GradientLog`, or the path of a log written with `sketch_dim=`.
        model: a built model of the architecture the log was written with (its
            layer names may differ).
        targets: `(x, y)` of the targets; a dict `x` may hold `"example_id"`
            (default ids `0..T-1`).

    Returns:
        An `Influence`, as `GradientLog.influence()` returns for exact scores;
        its `method` says how it was estimated.

    Raises:
        KeyError: if the log has no sketches.
        ValueError: for a model of another architecture or not built, a log
            without checkpoints, or targets that are not `(x, y)`.

    Example:

    ```python
    estimate = estimate_influence(log, model, ({"pixels": x_new, "example_id": ids}, y_new))
    estimate.proponents(target_id=ids[0], k=5)
    ```
    """
    reader = log if isinstance(log, GradientLog) else GradientLog(log)
    try:
        require_sketches(reader)
        sketch = reader.layout.sketch
        assert sketch is not None
        target_set: Any
        if keras.backend.backend() != "tensorflow":
            target_set = TargetExamples.from_argument(targets)
        else:
            from keras_gradtrack.attribution.targets import TargetSet

            target_set = TargetSet.from_argument(targets)
        sketches = checkpoint_sketches(
            model,
            sketch.dim,
            sketch.seed,
            sketch.widths,
            reader.checkpoints(),
            [(target_set.x, target_set.y, None)],
            *engine_sketch_functions(),
        )
        return influence_from_sketches(reader, sketches, target_set.example_ids)
    finally:
        if reader is not log:
            reader.close()
