"""The tracked step's phases one at a time: each takes values and returns values."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from layers_without_rule import NoRule

import keras_gradtrack as kgt
from keras_gradtrack import statistics
from keras_gradtrack.engine import (
    backward,
    plan,
    schedule,
    step,
    tracked_layer,
    tracking,
    tracking_check,
)

rng = np.random.default_rng(61)
X = rng.normal(size=(6, 4, 3)).astype("float32")
Y = rng.integers(0, 2, 6)


def model() -> Any:
    inputs = keras.Input((4, 3))
    sequence = keras.layers.Dense(5, activation="relu", name="sequence")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(sequence)
    hidden = NoRule(name="no_rule")(pooled)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    built = kgt.GradientTrackingModel(inputs, outputs)
    built.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return built


def traced_forward(built: Any) -> tuple[tracking.TrackingContext, Any, Any]:
    """A context whose forward pass ran (eagerly), with the tape and the loss."""
    context = tracking.TrackingContext(
        built, plan.build_plan(built), statistics.resolve(None), example_ids=None
    )
    with context, tf.GradientTape() as tape:
        loss = built.compute_loss(y=Y, y_pred=built(X, training=True))
    return context, tape, loss


def test_the_plan_is_frozen_and_in_variable_order() -> None:
    tracked = model().gradient_tracking_plan()
    assert [t.name for t in tracked] == ["sequence", "no_rule", "head"]
    assert [t.path for t in tracked] == ["rule:dense", tracked_layer.FALLBACK_PATH, "rule:dense"]
    with pytest.raises(AttributeError):
        tracked[0].name = "other"  # type: ignore[misc]


def test_covered_plan_takes_whole_layers_only() -> None:
    built = model()
    tracked = built.gradient_tracking_plan()
    head = built.get_layer("head")
    assert step.covered_plan(tracked, head.trainable_weights) == (tracked[2],)
    with pytest.raises(ValueError, match="some trainable variables of layer 'head'"):
        step.covered_plan(tracked, [head.kernel])


def test_forms_follow_the_calls_shapes() -> None:
    built = model()
    context, _, _ = traced_forward(built)
    calls = [tuple(r.call for r in tap.recorded) for tap in context.taps]
    assert step.layer_forms(context.plan, calls) == [
        tracking_check.MATERIALIZED,
        tracking_check.JACOBIAN,
        tracking_check.DIRECT,
    ]


def test_backward_gives_the_losses_shares_and_every_taps_gradient() -> None:
    built = model()
    context, tape, loss = traced_forward(built)
    request = backward.GradientRequest(tape, loss, tuple(built.trainable_weights))
    recorded = [tuple(tap.recorded) for tap in context.taps]
    layers = step.covered_layers(context, request.sources, recorded)
    forms = layers.forms
    assert layers.plan == context.plan and layers.columns == (0, 1, 2)
    result = backward.run_backward(context, request, layers)
    unreduced = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = unreduced(Y, built(X)).numpy()
    np.testing.assert_allclose(result.shares / result.factor, expected, rtol=1e-5)
    np.testing.assert_allclose(float(result.factor), 1 / 6, rtol=1e-6)
    # The materialized layer's weights are left to its per-example gradients.
    sequence = built.get_layer("sequence")
    assert id(sequence.kernel) not in result.weights
    assert [len(c) for c in result.calls] == [1, 1, 1]
    assert all(c[0].output_grads is not None for c in result.calls)
    materialized = backward.materialized_gradients(context.plan, result.calls, forms)
    assert materialized.per_example[id(sequence.kernel)].shape == (6, 15)
    assert materialized.chunks == {}  # a Dense rule has no `dot`


def test_the_schedule_reports_every_step_and_finishes_every_subscriber() -> None:
    state = schedule.GradientTrackingState()
    seen: dict[str, list[Any]] = {"a": [], "b": []}
    finished: list[str] = []

    def finish_b() -> None:
        finished.append("b")
        raise OSError("disk full")

    state.subscribe("a", [], 2, seen["a"].append, finish=lambda: finished.append("a"))
    state.subscribe("b", [], 3, seen["b"].append, finish=finish_b)
    for _ in range(6):
        due = state.due()
        state.report(4, {"x": np.ones(4)} if due else None, due)
    assert [r.step for r in seen["a"]] == list(range(6))
    assert [r.values is not None for r in seen["a"]] == [True, False, True, False, True, False]
    assert [r.values is not None for r in seen["b"]] == [True, False, False, True, False, False]
    with pytest.raises(OSError, match="disk full"):
        state.end_fit()
    assert sorted(finished) == ["a", "b"]
    assert state.due() == []
