"""Targets chosen after training on JAX: their gradient sketches at a log's checkpoints.

`keras_gradtrack.attribution.estimate_influence` pairs each logged row's sketch with
the targets' sketches at the last checkpoint before its step; on JAX the targets'
sketches come from here: the targets' pass of the tracked step
(`attribution.target_calls`, compiled loss, inference mode) and the same sketches
(`attribution.sketches`, the log's projections), jitted once and run at each
checkpoint's weights.

Example:

```python
found = checkpoint_sketches(model, 16, 0, widths, log.checkpoints(), targets)
found[0]    # (T, K) at the weights of step 0
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

from keras_gradtrack.backends.jax.attribution import lazy_per_example, sketches, target_calls
from keras_gradtrack.backends.jax.plan import build_plan
from keras_gradtrack.backends.jax.step import per_example_losses
from keras_gradtrack.engine.attribution_requests import (
    SketchRequest,
    TargetExamples,
    sketch_widths,
)
from keras_gradtrack.io.checkpoints import load_checkpoint


def checkpoint_sketches(
    model: keras.Model,
    dim: int,
    seed: int,
    widths: Sequence[int],
    checkpoints: Mapping[int, Path],
    targets: TargetExamples,
) -> dict[int, np.ndarray]:
    """`{step: (T, K) sketches}` of the targets at each checkpoint's weights; the
    model's own weights are put back afterwards.

    Args:
        model: A built model of the log's architecture.
        dim: The sketches' `dim`.
        seed: The sketches' seed.
        widths: The log's width of each sketched variable, to check the model with.
        checkpoints: `{step: weights file}`, as `io.checkpoints.checkpoints` lists them.
        targets: The examples.

    Raises:
        ValueError: if there is no checkpoint, the model is not built, or its tracked
            variables differ from the log's in number or in shape.
    """
    if not checkpoints:
        raise ValueError(
            "Sketched influence needs the weights saved during training; the log has no "
            "checkpoint (HDF5GradientLogger(sketch_dim=..., checkpoint_every=...) saves them)."
        )
    if not model.built:
        raise ValueError(
            f"Expected a built model of the log's architecture. Received: model "
            f"{model.name!r}, not built yet (call it on a batch first)."
        )
    plan = build_plan(model)
    found = sketch_widths([v for tracked in plan for v in tracked.variables], dim)
    if [width for _, width in found] != list(widths):
        raise ValueError(
            "Expected a model of the architecture the log was written with: the sketched "
            f"variables differ. Expected (in the log) widths {list(widths)}. Received: "
            f"{found}"
        )
    request = SketchRequest(dim, seed)
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    others = {id(v): i for i, v in enumerate(model.non_trainable_variables)}

    def target_losses(y: Any, y_pred: Any) -> Any:
        return per_example_losses(model, y, y_pred, None)[0]

    @jax.jit
    def compute(trainable: Any, non_trainable: Any) -> Any:
        def value(variable: Any) -> Any:
            if id(variable) in position:
                return trainable[position[id(variable)]]
            return non_trainable[others[id(variable)]]

        calls = target_calls(model, plan, targets, trainable, non_trainable, target_losses)
        return sketches(plan, calls, request, value, lazy_per_example(plan, calls, value))

    original = [np.array(w) for w in model.get_weights()]
    try:
        result = {}
        for step, path in sorted(checkpoints.items()):
            load_checkpoint(model, path)
            trainable = [v.value for v in model.trainable_variables]
            non_trainable = [v.value for v in model.non_trainable_variables]
            result[step] = np.asarray(compute(trainable, non_trainable))
        return result
    finally:
        model.set_weights(original)
