"""The tracked training step: one forward, one backward, the update, the statistics.

It does what `keras.Model.train_step` (TensorFlow backend) does, step for step,
and in the same backward pass takes the gradients at every tap and at the
per-example loss probe. From those the rules (or the per-layer fallback)
compute the primitives, and the statistics are reduced in the compiled step;
only `O(B x L)` numbers leave it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from keras import tree
from keras.src.losses import loss as loss_module

from keras_gradtrack.engine import data as batch_data
from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.fallback import fallback_gram, fallback_primitives
from keras_gradtrack.engine.plan import (
    TrackedLayer,
    refuse_calls_inside_loops,
    refuse_tied_variables,
)
from keras_gradtrack.engine.primitives import StepPrimitives
from keras_gradtrack.engine.taps import graph_ops_recorded, installed
from keras_gradtrack.rules.base import (
    Reference,
    flat_per_example,
    gram_of,
    materialized,
    sum_of_squares,
)
from keras_gradtrack.statistics import Statistic

PAYLOAD_KEY = "__gradtrack__"


def reduction_constant(model: Any, batch_size: tf.Tensor) -> tf.Tensor:
    """`c` with `loss = c * sum_i l_i (+ regularization)` on this replica.

    1 for "sum" losses; else `1 / (B * replicas)`, as Keras also divides a
    mean-reduced loss by the number of replicas.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    flat_losses = getattr(compile_loss, "_flat_losses", None) or []
    reductions = {getattr(entry.loss, "reduction", None) for entry in flat_losses}
    if reductions == {"sum"}:
        return tf.constant(1.0)
    return 1.0 / tf.cast(batch_size * distribute.num_replicas(), tf.float32)


def per_example_loss_error(model: Any) -> ValueError:
    return ValueError(
        "The loss cannot be reduced per example: the compiled loss of model "
        f"{model.name!r} does not depend on the sample weights, so example i's share "
        "`l_i` of the batch loss cannot be told apart. Use a keras.losses.Loss (or a "
        "plain `loss(y_true, y_pred)` function, which Keras wraps in one) in "
        "`compile`, and if you override `compute_loss`, pass `sample_weight` on to it."
    )


def layer_primitives(
    tracked: TrackedLayer, reference: Reference, per_example: dict[int, tf.Tensor]
) -> tuple[tf.Tensor, tf.Tensor]:
    calls = tracked.tap.calls
    if tracked.materialized:
        grads = [per_example[id(v)] for v in tracked.variables]
        result = materialized(grads, [reference(v) for v in tracked.variables])
    elif tracked.rule is not None:
        result = tracked.rule.primitives(tracked.layer, calls, reference)
    else:
        result = fallback_primitives(tracked.tap, tracked.variables, calls, reference)
    return result.sq_norm, result.dot


def layer_per_example(tracked: TrackedLayer) -> dict[int, tf.Tensor]:
    """`{id(variable): (B, n) d l_i / d variable}` from the layer's rule (after the backward pass)."""
    assert tracked.rule is not None and tracked.rule.per_example is not None
    pairs = tracked.rule.per_example(tracked.layer, tracked.tap.calls)
    grads = {id(variable): flat_per_example(grad) for variable, grad in pairs}
    if set(grads) != {id(v) for v in tracked.variables}:
        raise ValueError(
            f"Rule {tracked.rule.name!r} returned per-example gradients for "
            f"{[v.path for v, _ in pairs]} on layer {tracked.layer.name!r}, whose trainable "
            f"variables are {[v.path for v in tracked.variables]}."
        )
    return grads


def float_inputs(x: Any) -> list[tf.Tensor]:
    """The batch's float input tensors (for input gradients)."""
    inputs = [tf.convert_to_tensor(t) for t in tree.flatten(x) if t is not None]
    floats = [t for t in inputs if t.dtype.is_floating]
    if not floats:
        raise ValueError(
            "input_grad_norm needs float inputs: the gradient with respect to integer "
            f"inputs (such as token ids) is not defined. Received input dtypes: "
            f"{[t.dtype.name for t in inputs]}"
        )
    return floats


def layer_gram(tracked: TrackedLayer, per_example: dict[int, tf.Tensor]) -> tf.Tensor:
    calls = tracked.tap.calls
    if tracked.materialized:
        return gram_of([per_example[id(v)] for v in tracked.variables])
    if tracked.rule is not None and tracked.rule.gram is not None:
        return tracked.rule.gram(tracked.layer, calls)
    if tracked.rule is not None and tracked.rule.per_example is not None:
        return gram_of(list(layer_per_example(tracked).values()))
    return fallback_gram(tracked.tap, tracked.variables, calls)


def tracked_train_step(
    model: Any,
    data: Any,
    plan: Sequence[TrackedLayer],
    statistics: Sequence[Statistic],
    apply_update: bool = True,
) -> dict[str, Any]:
    """One training step of `model` that also returns the statistics' values.

    Args:
        model: A compiled model.
        data: One batch, as `fit` yields it.
        plan: The model's tracking plan (built during this trace).
        statistics: The statistics to compute.
        apply_update: False computes the statistics only: no weight update, no
            metric or loss-tracker update.

    Returns:
        The metrics dict of `keras.Model.train_step` (empty without update),
        plus the statistics under `PAYLOAD_KEY`.
    """
    x, y, sample_weight, example_ids = batch_data.unpack_batch(data)
    batch_size = batch_data.batch_size_of(x)
    trainable_weights = list(model.trainable_weights)
    taps = [tracked.tap for tracked in plan]

    watched_inputs = []
    if any(statistic.needs_input_gradients for statistic in statistics):
        watched_inputs = float_inputs(x)
    with tf.GradientTape() as tape:
        probe = tf.ones([batch_size], dtype=tf.float32)
        tape.watch(probe)
        tape.watch(watched_inputs)
        with installed(taps), graph_ops_recorded() as forward:
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
        loss = model._compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=batch_data.probe_sample_weight(sample_weight, probe, y_pred),
            training=True,
        )
        if apply_update:
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss), sample_weight=batch_size
            )
        refuse_activation_losses(model)
        refuse_calls_inside_loops(plan, forward.graph)
        refuse_tied_variables(plan, forward.range)
        loss_scale = tf.constant(1.0)
        scaled_loss = loss
        if model.optimizer is not None:
            scaled_loss = model.optimizer.scale_loss(loss)
            loss_scale = tf.cast(model.optimizer.scale_loss(tf.constant(1.0)), tf.float32)

    # Layers whose rule builds per-example gradients anyway: their batch gradient
    # is the sum of those, so the backward pass skips it.
    for tracked in plan:
        rule = tracked.rule
        tracked.materialized = rule is not None and rule.derives_gradients(
            tracked.layer, tracked.tap.calls
        )
    deriving = [tracked for tracked in plan if tracked.materialized]
    derived_ids = {id(v) for tracked in deriving for v in tracked.variables}
    backward_weights = [v for v in trainable_weights if id(v) not in derived_ids]
    tapped = [t for tap in taps for call in tap.calls for t in call.tapped]
    targets = [*backward_weights, *tapped, probe, *watched_inputs]
    gradients = tape.gradient(scaled_loss, targets)
    count = len(backward_weights)
    backward_gradients = dict(zip(map(id, backward_weights), gradients[:count]))
    tap_gradients = gradients[count : count + len(tapped)]
    probe_gradient = gradients[count + len(tapped)]
    input_gradients = gradients[count + len(tapped) + 1 :]
    if probe_gradient is None:
        raise per_example_loss_error(model)

    # The tape holds c * s * d l_i / d z_i (reduction constant, loss scale). The
    # rules are homogeneous in the output gradients (per-example gradients and
    # dots of degree 1, squared norms and Gram matrices of degree 2), so the
    # factor is divided out of their results, not out of every activation-sized
    # gradient.
    constant = reduction_constant(model, batch_size)
    unscale = 1.0 / (constant * loss_scale)
    position = 0
    for tap in taps:
        for call in tap.calls:
            call.output_grads = []
            for tensor in call.tapped:
                grad = tap_gradients[position]
                position += 1
                grad = tf.zeros_like(tensor) if grad is None else grad
                call.output_grads.append(tf.cast(grad, tf.float32))

    per_example: dict[int, tf.Tensor] = {}
    for tracked in deriving:
        per_example.update(layer_per_example(tracked))

    # Weight-sized tensors stay in the tape's scale: `raw` is what the optimizer
    # receives (s * G on this replica, s the loss scale), `data_part` its data part
    # (less this replica's share of the weight regularizers, which Keras divides
    # among the replicas), so S = sum over replicas of `data_part * unscale`. The
    # scale factors are applied to the (B,) and (L,) results, never elementwise
    # to a weight-sized tensor; without regularizers `data_part` is `raw` and each
    # variable's squared norm is taken once.
    regularization = weight_regularization_gradients(trainable_weights)
    replicas = distribute.num_replicas()
    raw: dict[int, tf.Tensor] = {}
    data_part: dict[int, tf.Tensor] = {}
    for v in trainable_weights:
        penalty = regularization.get(id(v))
        if id(v) in per_example:
            data_part[id(v)] = tf.reshape(tf.reduce_sum(per_example[id(v)], axis=0), v.shape)
            raw[id(v)] = data_part[id(v)]
            if penalty is not None:
                raw[id(v)] += penalty * (loss_scale / replicas)
            continue
        g = backward_gradients[id(v)]
        raw[id(v)] = (
            tf.zeros(v.shape) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
        )
        data_part[id(v)] = raw[id(v)]
        if penalty is not None:
            data_part[id(v)] -= penalty * (loss_scale / replicas)
    # What the optimizer receives: the backward pass' gradients, and the sums
    # of the derived ones (in the same scale).
    weight_gradients = [
        tf.cast(raw[id(v)], v.dtype) if id(v) in per_example else backward_gradients[id(v)]
        for v in trainable_weights
    ]
    if replicas == 1:
        batch_raw, sums, sum_scale = raw, data_part, unscale
    else:
        ids = [id(v) for v in trainable_weights]
        reduced = distribute.all_reduce_sum(
            [raw[i] for i in ids] + [data_part[i] * unscale for i in ids]
        )
        batch_raw = dict(zip(ids, reduced[: len(ids)]))
        sums = dict(zip(ids, reduced[len(ids) :]))
        sum_scale = tf.constant(1.0)

    reference = Reference(
        batch_raw,
        frozenset(
            id(v) for v in trainable_weights if replicas == 1 and id(v) not in regularization
        ),
    )

    squares: dict[int, tf.Tensor] = {}

    def squared_norm(gradients: dict[int, tf.Tensor], tracked: TrackedLayer) -> tf.Tensor:
        terms = []
        for v in tracked.variables:
            tensor = gradients[id(v)]
            if id(tensor) not in squares:
                squares[id(tensor)] = sum_of_squares(tensor)
            terms.append(squares[id(tensor)])
        return tf.add_n(terms)

    # The rules see `c * s * d l_i / d z_i` and `s * G`.
    dot_scale = unscale / loss_scale
    sq_norms, dots = [], []
    for tracked in plan:
        sq_norm, dot = layer_primitives(tracked, reference, per_example)
        sq_norms.append(tf.maximum(sq_norm, 0.0) * tf.square(unscale))
        dots.append(dot * dot_scale)
    gram = None
    if any(statistic.needs_gram for statistic in statistics):
        if distribute.num_replicas() > 1:
            raise ValueError(
                "Statistics that need the Gram matrix of per-example gradients (such as "
                "pairwise_cosine) pair examples across replicas and are not available "
                f"under a tf.distribute strategy. Received: {[s.name for s in statistics]}"
            )
        gram = tf.add_n([layer_gram(tracked, per_example) for tracked in plan])
        gram *= tf.square(unscale)
    rows = {
        "loss": tf.cast(probe_gradient, tf.float32) * unscale,
        "sq_norm": tf.stack(sq_norms, axis=1),
        "dot": tf.stack(dots, axis=1),
    }
    if example_ids is not None:
        rows["example_id"] = tf.cast(tf.reshape(example_ids, [-1]), tf.int64)
    if watched_inputs:
        rows["input_sq_norm"] = tf.add_n(
            [
                sum_of_squares(tf.reshape(tf.cast(g, tf.float32), [batch_size, -1]), axis=1)
                * tf.square(unscale)
                for g in input_gradients
                if g is not None
            ]
            or [tf.zeros([batch_size])]
        )
    rows = distribute.all_gather_rows(rows)
    global_batch_size = tf.shape(rows["loss"])[0]
    primitives = StepPrimitives(
        loss=rows["loss"],
        sq_norm=rows["sq_norm"],
        dot=rows["dot"],
        reference_sq_norm=tf.stack([squared_norm(batch_raw, t) for t in plan])
        / tf.square(loss_scale),
        sum_sq_norm=tf.stack([squared_norm(sums, t) for t in plan]) * tf.square(sum_scale),
        batch_size=tf.cast(global_batch_size, tf.float32),
        gram=gram,
        input_sq_norm=rows.get("input_sq_norm"),
    )
    payload = {statistic.name: statistic.compute(primitives) for statistic in statistics}
    payload["batch_size"] = global_batch_size
    if "example_id" in rows:
        payload["example_id"] = rows["example_id"]

    if not apply_update:
        return {PAYLOAD_KEY: payload}
    # Read before the update: the rate this step uses (schedules move with it).
    payload["learning_rate"] = tf.cast(model.optimizer.learning_rate, tf.float32)
    # No explicit ordering against the statistics: inside the compiled step,
    # reads and writes of a variable run in program order, so a layer re-run by
    # the fallback reads the weights before this update, and the update is free
    # to overlap with the rest of the statistics.
    if trainable_weights:
        model.optimizer.apply_gradients(zip(weight_gradients, trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=2)
    metrics = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return {**metrics, PAYLOAD_KEY: payload}


def refuse_activation_losses(model: Any) -> None:
    """Raises when a loss term added in `call` (activity regularization) depends on activations.

    Such a term reaches the taps' gradients but belongs to no example.
    """
    for layer in model._flatten_layers(include_self=True):
        if getattr(layer, "activity_regularizer", None) is not None or layer._losses:
            raise ValueError(
                f"Layer {layer.name!r} adds a loss in `call` (activity regularization or "
                "`add_loss`). Such a term depends on the activations of the whole batch, "
                "so per-example gradients would include it. Remove it, or use weight "
                "regularizers (kernel_regularizer=...), which are supported."
            )


def weight_regularization_gradients(trainable_weights: list[Any]) -> dict[int, tf.Tensor]:
    """Gradients of the weight regularizers alone (they are not part of any `g_i`)."""
    regularized = [v for v in trainable_weights if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return {}
    with tf.GradientTape() as tape:
        # The sum inside the tape: a sum taken after it would not be recorded.
        penalty = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
    gradients = tape.gradient(penalty, regularized)
    return {
        id(v): tf.cast(tf.convert_to_tensor(g), tf.float32)
        for v, g in zip(regularized, gradients)
        if g is not None
    }
