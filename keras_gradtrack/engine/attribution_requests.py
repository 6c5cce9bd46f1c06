"""The attribution requests as data, the same on every backend (no TensorFlow, no JAX).

A logger may ask a tracked step for per-example rows beside the statistics
(`AttributionRequest`): the products of each example's gradient with fixed
targets' gradients (`TargetExamples`: the targets' inputs, labels and ids) or a
sketch of each example's gradient (`SketchRequest`: the sketches' size and seed).
Each engine computes the rows its own way (the TensorFlow engine's
`attribution.targets.TargetSet` and `attribution.sketches.GradientSketch` add them
to these classes; the JAX engine's `backends/jax/attribution.py` reads these);
what the rows mean, and the sketches' random projections (`projection_matrices`,
numpy, from the seed and the variables' shapes only), are defined here once, so
that the same seed gives the same projections on every backend.

Example:

```python
targets = TargetExamples({"pixels": x_test[:8], "example_id": ids[:8]}, y_test[:8])
sketch = SketchRequest(dim=16, seed=0)
projection_matrices(16, 0, [(784, 256), (256,)])   # [(R, C), (R, C)]
```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import tree

EXAMPLE_ID_KEY = "example_id"
# Example ids are logged as int64, exactly: these dtypes convert to it losslessly.
EXAMPLE_ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")

_KEYS = itertools.count()


class AttributionRequest:
    """Per-example rows a logger asks the tracked step for, beside the statistics.

    Attributes:
        key: Where the step's payload holds the rows (unique per request).
    """

    def __init__(self) -> None:
        self.key = f"attribution_{next(_KEYS)}"


class TargetExamples(AttributionRequest):
    """Targets whose gradients every tracked step's per-example gradients are paired with.

    The step's rows are `(B, T)`: `<g_i(theta_t), g_j'(theta_t)>`, with `g_j'` the
    gradient of target j's loss (the compiled loss, without sample weight or
    regularization) in inference mode (`training=False`: no dropout).

    Args:
        x: The targets' inputs (an array, or a dict of arrays; a dict may hold
            `"example_id"`, one integer per target).
        y: Their labels, as `fit` takes them.

    Attributes:
        x: The inputs as numpy arrays (floats in `keras.backend.floatx()`).
        y: The labels, likewise.
        example_ids: int64 `(T,)`.

    Raises:
        ValueError: for no targets, inputs and labels of different lengths, ids
            that are not one integer per target, or repeated ids.

    Example:

    ```python
    targets = TargetExamples({"pixels": x_test[:64], "example_id": test_ids[:64]}, y_test[:64])
    len(targets)    # 64
    ```
    """

    def __init__(self, x: Any, y: Any):
        super().__init__()
        ids = None
        if isinstance(x, dict) and EXAMPLE_ID_KEY in x:
            ids = np.asarray(x[EXAMPLE_ID_KEY])
            if ids.dtype.name not in EXAMPLE_ID_DTYPES or ids.ndim != 1:
                raise ValueError(
                    f"Expected `{EXAMPLE_ID_KEY}` to hold one integer per target (a 1-D "
                    f"array of {', '.join(EXAMPLE_ID_DTYPES)}). Received: dtype "
                    f"{ids.dtype.name}, shape {ids.shape}"
                )
            rest = {key: value for key, value in x.items() if key != EXAMPLE_ID_KEY}
            x = next(iter(rest.values())) if len(rest) == 1 else rest
        lengths = {len(np.asarray(a)) for a in tree.flatten(x) + tree.flatten(y) if a is not None}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(
                "Expected targets as (x, y) with one row per target, at least one, in "
                f"every array. Received lengths: {sorted(lengths)}"
            )
        (count,) = lengths
        ids = np.arange(count, dtype=np.int64) if ids is None else ids.astype(np.int64)
        if len(ids) != count or len(np.unique(ids)) != count:
            raise ValueError(
                f"Expected one distinct `{EXAMPLE_ID_KEY}` per target ({count} targets). "
                f"Received: {len(np.unique(ids))} distinct ids in {len(ids)}"
            )
        self.x = tree.map_structure(_as_array, x)
        self.y = tree.map_structure(_as_array, y)
        self.example_ids = ids

    @classmethod
    def from_argument(cls, targets: Any) -> Any:
        """An instance of this class from `(x, y)` (or one already made).

        Raises:
            ValueError: unless `targets` is an `(x, y)` pair (or as the class says).
        """
        if isinstance(targets, cls):
            return targets
        if not isinstance(targets, (tuple, list)) or len(targets) != 2:
            raise ValueError(
                "Expected targets=(x, y): the targets' inputs (a dict may hold "
                f"'{EXAMPLE_ID_KEY}') and labels. Received: {type(targets).__name__}"
            )
        return cls(*targets)

    def __len__(self) -> int:
        return len(self.example_ids)


def matrix_sides(shape: Sequence[int]) -> tuple[int, int]:
    """`(rows, cols)` of a variable's gradient seen as a matrix: cols is the last axis."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def sketch_widths(variables: Sequence[Any], dim: int) -> list[tuple[str, int]]:
    """`(path, r_in * r_out)` of each of the sketched variables, in column order."""
    widths = []
    for variable in variables:
        rows, cols = matrix_sides(variable.shape)
        widths.append((variable.path, min(rows, dim) * min(cols, dim)))
    return widths


def projection_matrices(dim: int, seed: int, shapes: Sequence[Sequence[int]]) -> list[tuple]:
    """Per variable, `(R, C)` as float32 numpy arrays (identity for a side kept as is).

    A variable's gradient `M` (`matrix_sides`) is sketched as `R^T M C`; R and C are
    Gaussian with variance `1/dim`. The same `(seed, position)` always gives the
    same matrices, on every backend, so sketches made later (of targets) match
    those of the log.

    Example:

    ```python
    (rows, columns), (bias_rows, bias_columns) = projection_matrices(2, 0, [(5, 6), (6,)])
    rows.shape, columns.shape    # (5, 2), (6, 2)
    ```
    """
    matrices = []
    for position, shape in enumerate(shapes):
        rng = np.random.default_rng([seed, position])
        sides = []
        for size in matrix_sides(shape):
            if size <= dim:
                sides.append(np.eye(size, dtype=np.float32))
            else:
                gaussian = rng.standard_normal((size, dim)) / math.sqrt(dim)
                sides.append(gaussian.astype(np.float32))
        matrices.append(tuple(sides))
    return matrices


class SketchRequest(AttributionRequest):
    """Asks every tracked step for each example's gradient sketch: `(B, K)` rows.

    Each tracked variable's per-example gradient `M` (`matrix_sides`) becomes
    `R^T M C` (`projection_matrices`), flattened; the rows are the variables'
    sketches side by side, in the order of the model's tracking plan.

    Args:
        dim: The most dimensions each side of a variable's gradient matrix is
            projected to (a `(rows, cols)` kernel gives `min(rows, dim) *
            min(cols, dim)` numbers).
        seed: The seed of the random projections.

    Raises:
        ValueError: for a `dim` or `seed` that is not a positive (non-negative) int.

    Example:

    ```python
    sketch = SketchRequest(16, seed=0)
    sketch.widths(model)    # [('dense/kernel', 256), ('dense/bias', 16), ...]
    ```
    """

    def __init__(self, dim: int, seed: int = 0):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"Expected sketch_dim to be a positive int. Received: {dim!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"Expected sketch_seed to be a non-negative int. Received: {seed!r}")
        self.dim = dim
        self.seed = seed

    def widths(self, model: Any) -> list[tuple[str, int]]:
        """`(path, width)` of the sketched variables of `model` (every tracked layer's)."""
        variables = [v for tracked in model.gradient_tracking_plan() for v in tracked.variables]
        return sketch_widths(variables, self.dim)


def _as_array(array: Any) -> Any:
    if array is None:
        return None
    array = np.asarray(array)
    if array.dtype.kind == "f":
        array = array.astype(keras.backend.floatx())
    return array
