"""Any examples' gradient sketches at each checkpoint of a log, as the logger sketched.

A log written with `sketch_dim=` holds each trained example's gradient sketch at its
step; `sketch_examples` gives the same sketch of other examples (a target task's, a
validation set's) at the weights of each checkpoint, so that they can be compared
with the logged rows: cosines for data selection (LESS), products for influence.

Example:

```python
pool = kgt.HDF5GradientLogger("pool.h5", sketch_dim=8, overwrite=True)
model.fit(x_pool, y_pool, epochs=3, callbacks=[pool])
found = kgt.attribution.sketch_examples("pool.h5", model, x_targets, y_targets)
found[0].shape    # (n_targets, K): at the weights the first step began with
```
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gradtrack.analysis import GradientLog
from keras_gradtrack.analysis.influence import require_sketches
from keras_gradtrack.attribution.checkpoint_sketches import checkpoint_sketches
from keras_gradtrack.engine.attribution_requests import EXAMPLE_ID_KEY


def sketch_examples(
    log: GradientLog | str | os.PathLike[str],
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    batch_size: int = 32,
) -> dict[int, np.ndarray]:
    """Examples' gradient sketches at each checkpoint of a log, with the log's projections.

    Each checkpoint's weights are loaded into `model` in turn and every example's
    gradient `g_i = d l_i / d theta` (the compiled loss, its `sample_weight` included,
    as `fit` computes `l_i`) is projected as the logger projected the rows of
    `/per_example/gradient_sketch`: the same variables, columns, `sketch_dim` and seed.
    The pass runs in inference mode (`training=False`: no dropout, normalization with
    its moving statistics), so for a model that calls the same in both modes an
    example's sketch at a checkpoint equals the row the logger wrote for it if it was
    trained on in the step that began at that checkpoint. The model's weights are
    put back afterwards; its optimizer is not touched.

    Args:
        log: a `GradientLog`, or the path of a log written with `sketch_dim=`.
        model: a built, compiled model of the architecture the log was written with
            (its layer names may differ), on the backend Keras runs on.
        x: the examples' inputs, as `fit` takes them (arrays, or a dict of arrays; a
            dict's `"example_id"` is dropped as `fit` drops it).
        y: their labels, as `fit` takes them.
        sample_weight: their sample weights for the compiled loss, as `fit` takes them
            (one per example, or per output element), or None.
        batch_size: examples per compiled pass (each distinct batch shape is traced
            once; no step result depends on it beyond float32 rounding).

    Returns:
        `{step: float32 (n, K)}`, one entry per checkpoint, in step order: row i is
        example i's sketch at the weights that step began with.

    Raises:
        KeyError: if the log has no sketches.
        ValueError: for a model of another architecture or not built, a log without
            checkpoints, no examples, arrays of different lengths, or a `batch_size`
            that is not a positive integer.

    Example:

    ```python
    found = kgt.attribution.sketch_examples(log, model, x_task, y_task)  # {step: (n, K)}
    rows = log.per_example("gradient_sketch")[log.per_example("step") == 0]
    unit = lambda m: m / np.linalg.norm(m, axis=1, keepdims=True)
    cosines = unit(rows) @ unit(found[0]).T    # (step 0's rows, n): LESS's similarity
    ```
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"Expected batch_size to be a positive integer. Received: batch_size={batch_size!r}"
        )
    x, y, sample_weight = _examples(x, y, sample_weight)
    count = len(tree.flatten(x)[0])
    batches = [
        _rows((x, y, sample_weight), start, start + batch_size)
        for start in range(0, count, batch_size)
    ]
    reader = log if isinstance(log, GradientLog) else GradientLog(log)
    try:
        require_sketches(reader)
        sketch = reader.layout.sketch
        assert sketch is not None
        return checkpoint_sketches(
            model,
            sketch.dim,
            sketch.seed,
            sketch.widths,
            reader.checkpoints(),
            batches,
            *engine_sketch_functions(),
        )
    finally:
        if reader is not log:
            reader.close()


def engine_sketch_functions() -> tuple[Any, Any]:
    """`(build_plan, sketch_function)` of the engine of the backend Keras runs on: each
    engine sketches the examples itself, with the log's projections."""
    if keras.backend.backend() == "jax":
        from keras_gradtrack.backends.jax.plan import build_plan as jax_plan
        from keras_gradtrack.backends.jax.target_sketches import sketch_function as jax_sketches

        return jax_plan, jax_sketches
    if keras.backend.backend() == "torch":
        from keras_gradtrack.backends.torch.attribution import sketch_function as torch_sketches
        from keras_gradtrack.backends.torch.plan import build_plan as torch_plan

        return torch_plan, torch_sketches
    from keras_gradtrack.attribution.sketches import sketch_function
    from keras_gradtrack.engine.plan import build_plan

    return build_plan, sketch_function


def _examples(x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
    """`(x, y, sample_weight)` as numpy arrays (floats in `floatx`), `x` without its
    `"example_id"`; every array of the same length, at least one example."""
    if isinstance(x, dict) and EXAMPLE_ID_KEY in x:
        rest = {key: value for key, value in x.items() if key != EXAMPLE_ID_KEY}
        x = next(iter(rest.values())) if len(rest) == 1 else rest
    x, y, sample_weight = tree.map_structure(_as_array, (x, y, sample_weight))
    lengths = {len(a) for a in tree.flatten((x, y, sample_weight)) if a is not None}
    if len(lengths) != 1 or 0 in lengths:
        shapes = tree.map_structure(lambda a: None if a is None else a.shape, (x, y, sample_weight))
        raise ValueError(
            "Expected x, y (and sample_weight) with one row per example, at least one, in "
            f"every array. Received shapes (x, y, sample_weight): {shapes}"
        )
    return x, y, sample_weight


def _rows(data: Any, start: int, stop: int) -> Any:
    return tree.map_structure(lambda a: None if a is None else a[start:stop], data)


def _as_array(array: Any) -> Any:
    if array is None:
        return None
    array = np.asarray(array)
    return array.astype(keras.backend.floatx()) if array.dtype.kind == "f" else array
