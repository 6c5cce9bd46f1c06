"""The backward phase of a tracked step, and what follows directly from it.

One pass takes the gradients of the loss at the weights, at every tap, at every
recorded loss reduction and penalty, and at the watched inputs. From it come
each example's share of the loss, the loss's factor, and the per-example
gradients of the layers whose rule builds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack.engine import losses, reductions
from keras_gradtrack.engine.chunked import (
    Calls,
    Chunked,
    chunked_gradients,
    flat_gradients,
    takes_chunks,
)
from keras_gradtrack.engine.plan import Plan
from keras_gradtrack.engine.tracking import TrackingContext
from keras_gradtrack.engine.tracking_check import MATERIALIZED
from keras_gradtrack.rules import LayerCall


@dataclasses.dataclass(frozen=True)
class GradientRequest:
    """What the step asked `tracked_gradient` for: `tape.gradient(loss, sources)`.

    Attributes:
        tape: The step's tape.
        loss: The loss it differentiates.
        sources: The variables whose gradients the step applies.
        per_example_loss: The `(B,)` terms `loss` reduces, when the step passed them.
    """

    tape: tf.GradientTape
    loss: tf.Tensor
    sources: tuple[Any, ...]
    per_example_loss: tf.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class StepLayers:
    """The tracked layers a step's gradient covers, as the forward pass recorded them.

    Attributes:
        plan: The covered layers.
        columns: Their columns in the whole plan.
        calls: Per layer, its calls (no output gradients yet).
        forms: Per layer, its form in this step.
        broadcast: `id`s of the variables of layers with a call broadcast to the batch.
    """

    plan: Plan
    columns: tuple[int, ...]
    calls: tuple[Calls, ...]
    forms: tuple[str, ...]
    broadcast: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Backward:
    """What the one backward pass returned.

    Attributes:
        weights: `{id(source): gradient}` for the sources the pass differentiated
            (not the variables of materialized layers).
        calls: Per tracked layer, its calls with their output gradients.
        shares: `(B,)` each example's share of the (scaled) loss, `c s l_i`.
        factor: `c s`, the loss's factor (table in `engine.losses`) times the loss scale.
        penalty_weights: Per recorded penalty, `dL/dpenalty` (None if not in the loss).
        input_gradients: Gradients at the watched inputs.
        loss_cotangents: `(v, dL/dv)` for each loss value tensor the loss depends on
            (the recorded reductions' values, or the step's `per_example_loss`).
    """

    weights: dict[int, Any]
    calls: tuple[Calls, ...]
    shares: tf.Tensor
    factor: tf.Tensor
    penalty_weights: list[tf.Tensor | None]
    input_gradients: list[tf.Tensor | None]
    loss_cotangents: tuple[tuple[tf.Tensor, tf.Tensor], ...] = ()


def run_backward(
    context: TrackingContext, request: GradientRequest, layers: StepLayers
) -> Backward:
    """One backward pass for the weights, the taps, the losses and the penalties.

    Materialized layers' variables are left out: their gradient is the sum of
    the per-example gradients their rule builds.
    """
    derived = {
        id(v) for t, f in zip(layers.plan, layers.forms) if f == MATERIALIZED for v in t.variables
    }
    weights = [v for v in request.sources if id(v) not in derived]
    tapped = [t for layer_calls in layers.calls for call in layer_calls for t in call.tapped]
    if request.per_example_loss is not None:
        loss_targets = [request.per_example_loss]
    else:
        loss_targets = [record.values for record in context.losses.records]
    penalties = [penalty.value for penalty in context.penalties]
    targets = [*weights, *tapped, *loss_targets, *penalties, *context.watched_inputs]
    gradients = iter(request.tape.gradient(request.loss, targets))
    weight_gradients = {id(v): next(gradients) for v in weights}
    tap_gradients = [next(gradients) for _ in tapped]
    loss_gradients = [next(gradients) for _ in loss_targets]
    penalty_weights = [next(gradients) for _ in penalties]
    input_gradients = list(gradients)
    shares, factor = loss_shares(context, request.per_example_loss, loss_gradients)
    return Backward(
        weight_gradients,
        with_output_gradients(layers.calls, tap_gradients),
        shares,
        factor,
        penalty_weights,
        input_gradients,
        tuple((t, g) for t, g in zip(loss_targets, loss_gradients) if g is not None),
    )


def with_output_gradients(calls: Sequence[Calls], gradients: Sequence[Any]) -> tuple[Calls, ...]:
    """The calls with their output gradients filled in, float32: `gradients` holds one
    per tapped tensor, in the calls' order (None, where the loss does not reach the
    tensor, is zeros)."""
    remaining = iter(gradients)

    def filled(call: LayerCall) -> LayerCall:
        grads = []
        for tensor in call.tapped:
            grad = next(remaining)
            grads.append(tf.cast(tf.zeros_like(tensor) if grad is None else grad, tf.float32))
        return dataclasses.replace(call, output_grads=tuple(grads))

    return tuple(tuple(filled(call) for call in layer_calls) for layer_calls in calls)


def loss_shares(
    context: TrackingContext, per_example_loss: tf.Tensor | None, gradients: Sequence[Any]
) -> tuple[tf.Tensor, tf.Tensor]:
    """`(c s l_i, c s)`: each example's share of the loss and the loss's factor, from
    the gradients at the step's `per_example_loss` or at the recorded reductions."""
    if per_example_loss is not None:
        return user_loss_shares(per_example_loss, gradients[0])
    scale = context.loss_scale if context.loss_scale is not None else tf.constant(1.0)
    reductions.refuse_unknown_reductions(context.losses)
    connected = [r for r, g in zip(context.losses.records, gradients) if g is not None]
    shares = reductions.per_example_shares(context.losses.records, gradients)
    if shares is None:
        if context.losses.whole_batch:
            raise whole_batch_loss_error(context.model)
        raise per_example_loss_error(context.model)
    return shares, losses.loss_factor(connected, tf.shape(shares)[0]) * scale


def user_loss_shares(per_example_loss: tf.Tensor, gradient: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """`(c s l_i, c s)` for a per-example loss vector the step passed in."""
    if gradient is None:
        raise ValueError(
            "The loss does not depend on `per_example_loss`. Pass the (B,) vector of "
            "per-example losses that `loss` reduces (for example `loss = "
            "tf.reduce_mean(per_example_loss)`)."
        )
    values = tf.cast(tf.reshape(per_example_loss, [-1]), tf.float32)
    weights = tf.cast(tf.reshape(gradient, [-1]), tf.float32)
    # A mean or a sum: every example has the same factor.
    return values * weights, tf.reduce_mean(weights)


# Said by both loss refusals: when no per-example loss exists at all.
MIXED_LOSS_ADVICE = (
    "If each example's term depends on the other examples of the batch (a contrastive "
    "loss such as InfoNCE, SimCLR's or CLIP's, a triplet loss with in-batch negatives), "
    "no per-example gradient is defined for it, and the model cannot be tracked."
)


def per_example_loss_error(model: Any) -> ValueError:
    return ValueError(
        f"The loss of model {model.name!r} was not computed by a keras.losses.Loss in this "
        "step, so example i's share `l_i` of it cannot be told apart. If it is a mean or "
        "sum of per-example terms, use a Keras loss (`compile(loss=...)` and "
        "`self.compute_loss(...)`, or a keras.losses.Loss object), or pass the terms: "
        "`self.tracked_gradient(tape, loss, variables, per_example_loss=l)` with "
        f"`loss = tf.reduce_mean(l)`. {MIXED_LOSS_ADVICE}"
    )


def whole_batch_loss_error(model: Any) -> ValueError:
    return ValueError(
        f"A loss of model {model.name!r} returned one value for the whole batch: the loss "
        "function reduced over the batch itself (with `ops.mean`, say), so Keras received "
        "no per-example values and example i's share `l_i` cannot be told apart. Return "
        "one value per example (shape (batch,) or (batch, ...)) and let Keras reduce them "
        f"(the compiled loss' `reduction`). {MIXED_LOSS_ADVICE}"
    )


@dataclasses.dataclass(frozen=True)
class Materialized:
    """The materialized layers' per-example results.

    Attributes:
        per_example: `{id(variable): (B, n) d l_i / d variable}` (rules' scale),
            of the layers not in `chunks`.
        sums: `{id(variable): (n,)}` their sum over the batch.
        chunks: By column name, the layers taken chunk by chunk (`engine.chunked`).
    """

    per_example: dict[int, tf.Tensor]
    sums: dict[int, tf.Tensor]
    chunks: dict[str, Chunked]


def materialized_gradients(
    plan: Plan, calls: Sequence[Calls], forms: Sequence[str], keeps_per_example: bool = True
) -> Materialized:
    """The per-example gradients of the materialized layers, and their sums.

    Args:
        plan: The tracked layers.
        calls: Their calls with output gradients.
        forms: Their forms.
        keeps_per_example: Whether something besides the statistics' squared
            norms and dots reads the per-example gradients (a Gram matrix,
            targets, sketches); if not, layers whose rule has `dot` take large
            batches chunk by chunk.
    """
    per_example: dict[int, tf.Tensor] = {}
    sums: dict[int, tf.Tensor] = {}
    chunks: dict[str, Chunked] = {}
    for tracked, layer_calls, form in zip(plan, calls, forms):
        if form != MATERIALIZED:
            continue
        if takes_chunks(tracked, layer_calls, keeps_per_example):
            chunk = chunked_gradients(tracked, layer_calls, flat_gradients)
            chunks[tracked.name] = chunk
            sums.update(chunk.sums)
            continue
        grads = flat_gradients(tracked, layer_calls)
        for v, grad in zip(tracked.variables, grads):
            per_example[id(v)] = grad
            sums[id(v)] = tf.reduce_sum(grad, axis=0)
    return Materialized(per_example, sums, chunks)


def summed_gradient(
    variable: Any, sums: dict[int, tf.Tensor], penalty: tf.Tensor | None
) -> tf.Tensor:
    """The batch gradient of a materialized variable: the sum of its per-example
    gradients, plus its penalties' part."""
    total = tf.reshape(sums[id(variable)], variable.shape)
    if penalty is not None:
        total += penalty
    return tf.cast(total, variable.dtype)


def penalty_gradients(context: TrackingContext, weights: list[tf.Tensor | None]) -> dict[int, Any]:
    """`{id(variable): dL/dpenalty * d penalty / d variable}`: each penalty's part of the gradient."""
    parts: dict[int, Any] = {}
    for penalty, weight in zip(context.penalties, weights):
        if weight is None:
            continue
        with tf.GradientTape() as tape:
            value = penalty.variable.regularizer(penalty.variable)
        gradient = tf.cast(tf.convert_to_tensor(tape.gradient(value, penalty.variable)), tf.float32)
        parts[id(penalty.variable)] = parts.get(id(penalty.variable), 0.0) + weight * gradient
    return parts


def loss_scale_of(recorded: tf.Tensor | None) -> tf.Tensor | None:
    """The step's loss scale `s`, None when it is 1 (no scale recorded, or an optimizer
    without loss scaling, whose 1 is a constant of the trace): dividing by it is then
    left out, which changes no value."""
    if recorded is None or tf.get_static_value(recorded) == 1.0:
        return None
    return recorded


def dense_float(gradient: Any) -> tf.Tensor:
    """A gradient of the tape as a dense float32 tensor (an `IndexedSlices`, such as an
    Embedding's, densified)."""
    return tf.cast(tf.convert_to_tensor(gradient), tf.float32)
