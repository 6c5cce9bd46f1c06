"""The per-layer phase of a tracked step: the reference, the sums, every layer's primitives.

Weight-sized tensors stay in the tape's scale: `raw` is what the optimizer
receives (`s G` on this replica), `data` its data part (without the penalties),
so `S = sum over replicas of data / (c s)`. The factors go on the `(B,)` and
`(L,)` results, never elementwise on a weight-sized tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras import ops

from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.backward import Calls, Materialized, dense_float, loss_scale_of
from keras_gradtrack.engine.fallback import fallback_gram, fallback_primitives
from keras_gradtrack.engine.plan import Plan, TrackedLayer
from keras_gradtrack.engine.step_state import StepState
from keras_gradtrack.engine.tracking_check import COUPLED, MATERIALIZED
from keras_gradtrack.rule_math import total
from keras_gradtrack.rules import Reference
from keras_gradtrack.rules.ops import (
    flat_per_example,
    gram_of,
    materialized,
    references_of,
    sum_of_squares,
)
from keras_gradtrack.statistics import StepPrimitives


@dataclasses.dataclass(frozen=True)
class BatchSums:
    """The step's weight-sized sums, in the tape's scale (see the module docstring).

    Attributes:
        raw: `{id(variable): s G}`, what the optimizer receives, summed over replicas.
        data: `{id(variable): data part}` (without the penalties), summed over
            replicas: `S` once multiplied by `data_scale`.
        data_scale: The factor of `data`.
        reference: The rules' reference, `raw`.
    """

    raw: dict[int, Any]
    data: dict[int, Any]
    data_scale: Any
    reference: Reference


def step_primitives(state: StepState, gradients: Sequence[Any]) -> StepPrimitives:
    """The batch reference and sums, every layer's primitives, gathered across replicas.

    Args:
        state: The step after its backward pass.
        gradients: The gradients the optimizer receives, one per source.
    """
    context, plan = state.context, state.layers.plan
    unscale = 1.0 / state.backward.factor
    scale = loss_scale_of(context.loss_scale)
    sums = batch_sums(state, gradients, unscale)
    # The products with the batch gradient only for statistics that read them.
    wants_dots = any(statistic.needs_dot for statistic in context.statistics)
    rows = per_example_rows(state, sums.reference if wants_dots else None, unscale, scale)
    gram = None
    if any(statistic.needs_gram for statistic in context.statistics):
        gram = step_gram(state) * ops.square(unscale)
    rows = distribute.all_gather_rows(rows)
    raw_sq_norms = squared_norms(sums.raw, plan, context.xla)
    # Without penalties (on one replica) the data part is the batch gradient itself.
    same = all(sums.data[i] is sums.raw[i] for i in sums.raw)
    data_sq_norms = raw_sq_norms if same else squared_norms(sums.data, plan, context.xla)
    return StepPrimitives(
        loss=rows["loss"],
        sq_norm=rows["sq_norm"],
        dot=rows.get("dot"),
        reference_sq_norm=raw_sq_norms if scale is None else raw_sq_norms / ops.square(scale),
        sum_sq_norm=data_sq_norms * ops.square(sums.data_scale),
        batch_size=ops.cast(ops.shape(rows["loss"])[0], "float32"),
        gram=gram,
        input_sq_norm=rows.get("input_sq_norm"),
    )


def batch_sums(state: StepState, gradients: Sequence[Any], unscale: Any) -> BatchSums:
    """The batch gradient and the sum of the per-example gradients of the covered
    layers, all-reduced across replicas; `unscale` is `1 / (c s)`."""
    variables = [v for tracked in state.layers.plan for v in tracked.variables]
    by_id = {id(v): gradient for v, gradient in zip(state.request.sources, gradients)}
    raw = {
        id(v): ops.zeros(v.shape) if by_id[id(v)] is None else dense_float(by_id[id(v)])
        for v in variables
    }
    penalties = state.penalties
    data = {i: raw[i] - penalties[i] if i in penalties else raw[i] for i in raw}
    if distribute.num_replicas() == 1:
        reference = Reference(raw, frozenset(i for i in raw if i not in penalties))
        return BatchSums(raw, data, unscale, reference)
    ids = list(raw)
    reduced = distribute.all_reduce_sum([raw[i] for i in ids] + [data[i] * unscale for i in ids])
    batch_raw = dict(zip(ids, reduced[: len(ids)]))
    sums = dict(zip(ids, reduced[len(ids) :]))
    one = ops.convert_to_tensor(1.0)
    return BatchSums(batch_raw, sums, one, Reference(batch_raw, frozenset()))


def per_example_rows(
    state: StepState, reference: Reference | None, unscale: Any, scale: Any
) -> dict[str, Any]:
    """This replica's `loss`, `sq_norm` and `dot` rows (no `dot` without a `reference`;
    `input_sq_norm` where inputs are watched); the rules see `c s d l_i / d z_i` and
    `s G` (`scale` is `s`, None for 1).

    The layers' columns are stacked first and scaled together: one op per factor
    for all layers, not one per layer (each op costs the executor the same on a
    `(B,)` column as on the `(B, L)` matrix).
    """
    primitives = layers_primitives(state, reference)
    sq_norm = ops.stack([sq_norm for sq_norm, _ in primitives], axis=1)
    rows = {
        "loss": state.backward.shares * unscale,
        "sq_norm": ops.maximum(sq_norm, 0.0) * ops.square(unscale),
    }
    if reference is not None:
        dot = ops.stack([dot for _, dot in primitives], axis=1) * unscale
        rows["dot"] = dot if scale is None else dot / scale
    if state.context.watched_inputs:
        gradients = state.backward.input_gradients
        rows["input_sq_norm"] = input_sq_norm(gradients, unscale, rows["loss"], state.context.xla)
    return rows


def layers_primitives(state: StepState, reference: Reference | None) -> list[tuple[Any, Any]]:
    """Per covered layer, `(sq_norm, dot)` in the rules' scale, by its form (no dot,
    and no product with the batch gradient, without a `reference`)."""
    coupled = state.coupled.primitives(reference) if state.coupled is not None else {}
    return [
        coupled[tracked.name]
        if form == COUPLED
        else layer_primitives(tracked, calls, form, reference, state.materialized)
        for tracked, calls, form in zip(state.layers.plan, state.backward.calls, state.layers.forms)
    ]


def squared_norms(gradients: dict[int, Any], plan: Plan, xla: bool) -> Any:
    """`(L,)` per-layer squared norms; a tensor shared by two entries is squared once
    (`xla`: the step is compiled by XLA)."""
    squares: dict[int, Any] = {}
    per_layer = []
    for tracked in plan:
        terms = []
        for v in tracked.variables:
            tensor = gradients[id(v)]
            if id(tensor) not in squares:
                squares[id(tensor)] = sum_of_squares(tensor, xla=xla)
            terms.append(squares[id(tensor)])
        per_layer.append(total(terms))
    return ops.stack(per_layer)


def layer_primitives(
    tracked: TrackedLayer,
    calls: Calls,
    form: str,
    reference: Reference | None,
    materialized_layers: Materialized,
) -> tuple[Any, Any]:
    """`(sq_norm, dot)` of one layer, by its form: materialized (whole or chunk by
    chunk, from `materialized_layers`), its rule, or the fallback."""
    chunk = materialized_layers.chunks.get(tracked.name)
    if chunk is not None:
        dot = None if reference is None else chunk.dot(tracked, calls, reference)
        return chunk.sq_norm, dot
    if form == MATERIALIZED:
        grads = [materialized_layers.per_example[id(v)] for v in tracked.variables]
        references = references_of(reference, tracked.variables)
        result = materialized(grads, references, calls[0].xla)
    elif tracked.rule is not None:
        result = tracked.rule.primitives(tracked.layer, calls, reference)
    else:
        result = fallback_primitives(tracked.layer, tracked.variables, calls, reference)
    return result.sq_norm, result.dot


def step_gram(state: StepState) -> Any:
    """`(B, B)` `<g_i, g_j>` over every covered layer (in the rules' scale squared)."""
    if distribute.num_replicas() > 1:
        raise ValueError(
            "Statistics that need the Gram matrix of per-example gradients (such as "
            "pairwise_cosine) pair examples across replicas and are not available "
            "under a tf.distribute strategy."
        )
    coupled, per_example = state.coupled, state.materialized.per_example
    grams = list(coupled.grams().values()) if coupled is not None else []
    for tracked, layer_calls, form in zip(
        state.layers.plan, state.backward.calls, state.layers.forms
    ):
        rule = tracked.rule
        if form == COUPLED:
            continue
        if form == MATERIALIZED:
            grams.append(gram_of([per_example[id(v)] for v in tracked.variables]))
        elif rule is not None and rule.gram is not None:
            grams.append(rule.gram(tracked.layer, layer_calls))
        elif rule is not None and rule.per_example is not None:
            pairs = rule.per_example(tracked.layer, layer_calls)
            grams.append(gram_of([flat_per_example(g) for _, g in pairs]))
        else:
            grams.append(fallback_gram(tracked.layer, tracked.variables, layer_calls))
    return total(grams)


def input_sq_norm(gradients: Sequence[Any], unscale: Any, like: Any, xla: bool) -> Any:
    """`(B,)` `||d l_i / d x_i||^2` over the watched float inputs (`xla`: the step is
    compiled by XLA)."""
    batch = ops.shape(like)[0]
    terms = [
        sum_of_squares(ops.reshape(ops.cast(g, "float32"), (batch, -1)), axis=1, xla=xla)
        for g in gradients
        if g is not None
    ]
    summed = total(terms) if terms else ops.zeros((batch,))
    return summed * ops.square(unscale)
