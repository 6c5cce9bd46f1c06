"""The phases of a tracked step after its forward pass, run by `tracked_gradient`.

checks -> the covered layers and their forms -> backward (`engine.backward`: one
pass for the weights, every tap, every recorded loss and penalty; then the
per-example gradients of the layers whose rule builds them), which makes the
`StepState` the later phases read -> the gradients -> the private step
(`engine.clipping`) -> batch reference and sums, all-reduced across replicas,
every layer's primitives (`engine.per_layer`) and the statistics -> the payload.
The update is the caller's: `tracked_gradient` returns the gradients that
`tape.gradient` would have, and the step applies them as it always does.
Each phase takes values and returns values; none writes into shared objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import tensorflow as tf

from keras_gradtrack.engine import checks, clipping, distribute, refusals
from keras_gradtrack.engine.backward import (
    Backward,
    Calls,
    GradientRequest,
    StepLayers,
    materialized_gradients,
    penalty_gradients,
    run_backward,
    summed_gradient,
)
from keras_gradtrack.engine.batchless import refuse_batchless_outputs_mixing_rows
from keras_gradtrack.engine.clipping import PrivateStep
from keras_gradtrack.engine.coupled import (
    CoupledGradients,
    chunk_size_of,
    coupled_layer_names,
    refuse_coupled_input_gradients,
)
from keras_gradtrack.engine.per_layer import step_primitives
from keras_gradtrack.engine.plan import Plan
from keras_gradtrack.engine.requests import attribution_rows
from keras_gradtrack.engine.step_state import StepState
from keras_gradtrack.engine.taps import RecordedCall
from keras_gradtrack.engine.tracking import StepResult, TrackingContext
from keras_gradtrack.engine.tracking_check import COUPLED, DIRECT, JACOBIAN, MATERIALIZED
from keras_gradtrack.statistics import Statistic

Recorded = Sequence[tuple[RecordedCall, ...]]


def tracked_gradient(
    context: TrackingContext,
    tape: tf.GradientTape,
    loss: tf.Tensor,
    sources: Sequence[Any],
    per_example_loss: tf.Tensor | None = None,
) -> list[Any]:
    """`tape.gradient(loss, sources)`, computing the statistics on the way.

    Leaves the statistics and each layer's form in `context.result`.
    """
    context.stop_recording()
    request = GradientRequest(tape, loss, tuple(sources), per_example_loss)
    recorded = [tuple(tap.recorded) for tap in context.taps]
    refuse_untrackable_step(context, recorded)
    layers = covered_layers(context, request.sources, recorded)
    state = after_backward(context, request, layers)
    gradients = batch_gradients(state)
    # A private model's optimizer receives the clipped, noisy sum instead (DP-SGD).
    private = clipping.private_step(state)
    statistics, batch_size = step_statistics(state, gradients, private)
    attribution = attribution_rows(
        context, layers.plan, state.backward, layers.forms, state.materialized.per_example
    )
    payload = {
        **statistics,
        **attribution,
        "batch_size": tf.cast(batch_size, tf.int32),
        **step_rows(context, private),
    }
    forms = {tracked.name: form for tracked, form in zip(layers.plan, layers.forms)}
    context.result = StepResult(payload, forms)
    return gradients if private is None else private.gradients


def refuse_untrackable_step(context: TrackingContext, recorded: Recorded) -> None:
    """The checks a traced step must pass before its backward pass.

    Raises:
        ValueError: As the first failing check says.
    """
    checks.refuse_activation_losses(context.model)
    checks.refuse_calls_inside_loops(context.plan, recorded, context.forward.graph)
    own_ops = [
        [*(c.graph_ops for c in calls), *(p.graph_ops for p in context.penalties)]
        for calls in recorded
    ]
    checks.refuse_tied_variables(context.plan, own_ops, context.forward.range)
    refuse_coupled_input_gradients(context.coupling, context.statistics)
    refuse_batchless_outputs_mixing_rows(context.taps, context.forward.range, context.batch)


def covered_layers(
    context: TrackingContext, sources: Sequence[Any], recorded: Recorded
) -> StepLayers:
    """The tracked layers whose variables are among the sources, their recorded calls
    and forms (a covered layer the forward pass did not call is refused, naming it)."""
    plan = covered_plan(context.plan, sources)
    columns = tuple(context.plan.index(tracked) for tracked in plan)
    calls = tuple(tuple(r.call for r in recorded[column]) for column in columns)
    refusals.refuse_uncalled_layers(plan, {index for index, found in enumerate(calls) if found})
    forms = layer_forms(plan, calls, coupled_layer_names(context.coupling, plan))
    # A batchless call broadcast to the batch (see `merged_broadcast_rows`).
    broadcast = frozenset(
        id(v)
        for tracked, column in zip(plan, columns)
        if any(call.batchless for call in recorded[column])
        for v in tracked.variables
    )
    return StepLayers(plan, columns, calls, tuple(forms), broadcast)


def after_backward(
    context: TrackingContext, request: GradientRequest, layers: StepLayers
) -> StepState:
    """The backward pass, and what follows from it alone: the coupled layers' Jacobian
    rows, the materialized layers' per-example gradients, the penalties' parts."""
    backward = run_backward(context, request, layers)
    keeps_per_example = bool(context.requests) or any(
        statistic.needs_gram for statistic in context.statistics
    )
    return StepState(
        context,
        request,
        layers,
        backward,
        coupled=coupled_gradients(context, layers.plan, layers.forms, backward),
        materialized=materialized_gradients(
            layers.plan, backward.calls, layers.forms, keeps_per_example
        ),
        penalties=penalty_gradients(context, backward.penalty_weights),
    )


def batch_gradients(state: StepState) -> list[Any]:
    """The gradients `tape.gradient` returns: the backward pass' where it took them, the
    sums of the per-example gradients (plus the penalties' parts) of materialized layers."""
    weights, sums = state.backward.weights, state.materialized.sums
    gradients = [
        weights[id(v)] if id(v) in weights else summed_gradient(v, sums, state.penalties.get(id(v)))
        for v in state.request.sources
    ]
    return merged_broadcast_rows(state.layers.broadcast, state.request.sources, gradients)


def step_statistics(
    state: StepState, gradients: Sequence[Any], private: PrivateStep | None
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """The statistics, spread over every column of the plan, and the (global) batch size.

    A private step without statistics skips them (and their all-reduces): none, and
    the private step's batch size.
    """
    context = state.context
    if private is not None and not context.statistics:
        return {}, private.batch_size
    primitives = step_primitives(state, gradients)
    payload = {s.name: s.compute(primitives) for s in context.statistics}
    payload = widened(payload, context.statistics, state.layers.columns, len(context.plan))
    return payload, primitives.batch_size


def step_rows(context: TrackingContext, private: PrivateStep | None) -> dict[str, tf.Tensor]:
    """The step's rows besides the statistics: the examples' ids, the learning rate,
    and a private step's own."""
    rows = {}
    if context.example_ids is not None:
        rows["example_id"] = distribute.all_gather_rows(
            {"ids": tf.cast(tf.reshape(context.example_ids, [-1]), tf.int64)}
        )["ids"]
    optimizer = getattr(context.model, "optimizer", None)
    # Read before the update: the rate this step uses (schedules move with it).
    learning_rate = optimizer.learning_rate if optimizer is not None else float("nan")
    rows["learning_rate"] = tf.cast(learning_rate, tf.float32)
    if private is not None:
        rows.update(private.rows)
    return rows


def merged_broadcast_rows(
    broadcast: AbstractSet[int], sources: Sequence[Any], gradients: list[Any]
) -> list[Any]:
    """The gradients, with each row of a sparse gradient of a broadcast layer once.

    A batchless call broadcast to the batch (a position table looked up by
    `arange(maxlen)`) looks every row up once per example, so its variable's
    sparse gradient lists each row B times where plain Keras lists it once.
    Their sum is the same, but an optimizer's sparse update is not linear in the
    rows (Adam squares each row it receives): the rows are summed per index, as
    plain Keras' gradient holds them. `broadcast` holds the `id`s of those variables.
    """
    return [
        unique_rows(gradient)
        if id(v) in broadcast and isinstance(gradient, tf.IndexedSlices)
        else gradient
        for v, gradient in zip(sources, gradients)
    ]


def unique_rows(gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """`gradient` with its rows summed per index, indices in order of first appearance."""
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)


def covered_plan(plan: Plan, sources: Sequence[Any]) -> Plan:
    """The tracked layers whose variables are the sources (all of them, or none).

    Raises:
        ValueError: If a layer has only some of its trainable variables among them.
    """
    source_ids = {id(v) for v in sources}
    covered = []
    for tracked in plan:
        inside = [id(v) in source_ids for v in tracked.variables]
        if all(inside):
            covered.append(tracked)
        elif any(inside):
            raise ValueError(
                f"The gradient asked for holds some trainable variables of layer "
                f"{tracked.layer.name!r} but not others; per-layer statistics need all of "
                f"them. Received sources without: "
                f"{[v.path for v, i in zip(tracked.variables, inside) if not i]}"
            )
    if not covered:
        raise ValueError(
            "None of the sources is a trainable variable of a tracked layer, so there is "
            f"nothing to track. Received: {[getattr(v, 'path', v) for v in sources]}"
        )
    return tuple(covered)


def layer_forms(
    plan: Plan, calls: Sequence[Calls], coupled: AbstractSet[str] = frozenset()
) -> list[str]:
    """Each layer's form in this step: coupled (`coupled` names those layers), else from
    the calls' static shapes."""
    forms = []
    for tracked, layer_calls in zip(plan, calls):
        if tracked.name in coupled:
            forms.append(COUPLED)
        elif tracked.rule is None:
            forms.append(JACOBIAN)
        elif tracked.rule.derives_gradients(tracked.layer, layer_calls):
            forms.append(MATERIALIZED)
        else:
            forms.append(DIRECT)
    return forms


def coupled_gradients(
    context: TrackingContext, plan: Plan, forms: Sequence[str], backward: Backward
) -> CoupledGradients | None:
    """The Jacobian rows of the coupled layers, if the step has any."""
    layers = [tracked for tracked, form in zip(plan, forms) if form == COUPLED]
    if not layers:
        return None
    assert context.coupling is not None and context.coupling.tape is not None
    return CoupledGradients(
        context.coupling.tape, layers, backward.loss_cotangents, chunk_size_of(context.model)
    )


def widened(
    payload: dict[str, tf.Tensor],
    statistics: Sequence[Statistic],
    columns: Sequence[int],
    width: int,
) -> dict[str, tf.Tensor]:
    """Per-layer statistics of the covered layers spread over all `width` columns, NaN
    in the columns of layers the step's gradient did not cover."""
    if len(columns) == width:
        return payload
    # Column j reads covered column `columns.index(j)`, or the appended NaN column.
    index = [columns.index(j) if j in columns else len(columns) for j in range(width)]
    out = dict(payload)
    for statistic in statistics:
        if statistic.per_layer:
            value = payload[statistic.name]
            nan = tf.fill(tf.concat([tf.shape(value)[:-1], [1]], axis=0), float("nan"))
            out[statistic.name] = tf.gather(tf.concat([value, nan], axis=-1), index, axis=-1)
    return out
