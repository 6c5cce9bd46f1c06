"""Gradient sketches: per-example gradients projected to a few numbers, for targets chosen later.

Exact influence on a target needs the target's gradient at every step's
weights, so the target must be known before training (`attribution.targets`). For a
target chosen afterwards, the log keeps a sketch of each example's gradient
(`GradientSketch`), and the logger saves the weights at chosen steps; a
target's sketch at a checkpoint then stands in for its gradient at the steps
after it (`sketch_function`, run at each checkpoint by `checkpoint_sketches.py`),
and `<sketch_i, sketch_target>` for `<g_i, g_target>`.

A variable's gradient, seen as a (rows, cols) matrix `M` (cols its last axis),
is sketched as `R^T M C` (LoGra's Kronecker-structured projection, Choe et al.
2024): R (rows, r_in) and C (cols, r_out) are Gaussian with variance `1/r`, so
inner products are preserved in expectation; a side of at most `dim` entries is
kept as it is (`R = I`), so small variables are exact. A rule's `sketch` applies
R and C to the layer's factors (Dense: `sum_t (R^T a_t)(C^T d_t)^T`) without
building `M`; other layers project their per-example gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from keras_gradtrack.attribution.targets import layer_per_example, target_pass
from keras_gradtrack.engine.attribution_requests import SketchRequest, projection_matrices
from keras_gradtrack.engine.attribution_requests import sketch_widths as variable_sketch_widths
from keras_gradtrack.engine.backward import Calls
from keras_gradtrack.engine.plan import Plan, TrackedLayer, build_plan
from keras_gradtrack.engine.requests import BatchGradients
from keras_gradtrack.engine.tracking_check import DIRECT, MATERIALIZED
from keras_gradtrack.rules import Projection
from keras_gradtrack.rules.ops import reshape_per_example, sketch_of


def sketch_widths(plan: Plan, dim: int) -> list[tuple[str, int]]:
    """`(path, r_in * r_out)` of each of `plan`'s variables, in column order."""
    return variable_sketch_widths([v for tracked in plan for v in tracked.variables], dim)


def projection_of(plan: Plan, dim: int, seed: int) -> Projection:
    """The rules' view of the projections of `plan`'s variables (constants of the graph)."""
    variables = [v for tracked in plan for v in tracked.variables]
    matrices = projection_matrices(dim, seed, [v.shape for v in variables])
    return Projection(
        {
            id(v): (tf.constant(rows), tf.constant(columns))
            for v, (rows, columns) in zip(variables, matrices)
        }
    )


def layer_sketches(
    tracked: TrackedLayer,
    calls: Calls,
    form: str,
    per_example: Mapping[int, tf.Tensor],
    projection: Projection,
) -> list[tf.Tensor]:
    """Per variable of the layer, in order, its `(B, r_in * r_out)` sketches."""
    rule = tracked.rule
    if form != MATERIALIZED and rule is not None and rule.sketch is not None:
        by_variable = {id(v): s for v, s in rule.sketch(tracked.layer, calls, projection)}
        sketches = [by_variable[id(v)] for v in tracked.variables]
    else:
        if form == MATERIALIZED:
            gradients = [per_example[id(v)] for v in tracked.variables]
        else:
            gradients = layer_per_example(tracked, calls)
        sketches = [sketch_of(v, g, projection) for v, g in zip(tracked.variables, gradients)]
    return [reshape_per_example(s, [-1]) for s in sketches]


class GradientSketch(SketchRequest):
    """A `SketchRequest` (its arguments and checks) whose rows the TensorFlow engine
    computes in its tracked step: each example's gradient sketch, `(B, K)` rows."""

    def widths(self, model: Any) -> list[tuple[str, int]]:
        """`(path, width)` of the sketched variables of `model` (every tracked layer's)."""
        return sketch_widths(build_plan(model), self.dim)

    def rows(self, batch: BatchGradients) -> tf.Tensor:
        full_plan = build_plan(batch.model)
        projection = projection_of(full_plan, self.dim, self.seed)
        sketches = {}
        for tracked, calls, form in zip(batch.plan, batch.calls, batch.forms):
            layer = layer_sketches(tracked, calls, form, batch.per_example, projection)
            sketches.update({v.path: s for v, s in zip(tracked.variables, layer)})
        count = tf.shape(next(iter(sketches.values())))[0]
        # Variables the step's gradient does not cover have no gradient: zeros.
        columns = [
            sketches[path] if path in sketches else tf.zeros([count, width])
            for path, width in sketch_widths(full_plan, self.dim)
        ]
        return tf.concat(columns, axis=1) / batch.factor


def sketch_function(model: Any, plan: Plan, dim: int, seed: int) -> Callable[..., Any]:
    """The TensorFlow engine's `SketchFunction` (`attribution/checkpoint_sketches.py`):
    one `tf.function` giving the `(n, K)` sketches of examples `(x, y, sample_weight)` at
    the model's current weights, traced once per shape of the examples."""

    @tf.function(autograph=False)
    def sketches(x: Any, y: Any, sample_weight: Any) -> tf.Tensor:
        calls, factor = target_pass(model, plan, x, y, sample_weight=sample_weight)
        projection = projection_of(plan, dim, seed)
        columns = []
        for tracked, layer_calls in zip(plan, calls):
            columns += layer_sketches(tracked, layer_calls, DIRECT, {}, projection)
        return tf.concat(columns, axis=1) / factor

    return sketches
