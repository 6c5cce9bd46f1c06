"""Know before you train: the path each tracked layer will take, and why.

`check(model)` lists every layer that owns trainable variables with the path its
per-example gradients will take (a rule and its form, the fallback, or refused)
before any step. The forms depend on shapes, so the model's forward pass is traced
once with the taps on symbolic inputs of the model's input shapes, and the
trace-time checks of a tracked step run on that trace. Nothing runs: no weight,
no optimizer state and no random state changes. What depends on the loss (its
reduction) is checked at the first tracked step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from keras_gradtrack import statistics
from keras_gradtrack._keras_seam import build_shapes, functional_inputs
from keras_gradtrack._patching import patched_each
from keras_gradtrack.engine import checks, clipping
from keras_gradtrack.engine.batchless import rows_mixing_errors
from keras_gradtrack.engine.coupled import coupled_layer_names
from keras_gradtrack.engine.data import split_example_ids
from keras_gradtrack.engine.independence import (
    find_example_mixing,
    mixing_error,
    rows,
    states_restored,
)
from keras_gradtrack.engine.plan import (
    Plan,
    TrackedLayer,
    example_mixing_refusal,
    tracked_layers,
)
from keras_gradtrack.engine.step import layer_forms
from keras_gradtrack.engine.tracking import TrackingContext
from keras_gradtrack.engine.tracking_check import (
    COUPLED,
    FALLBACK,
    JACOBIAN,
    MATERIALIZED,
    REFUSED,
    UNKNOWN,
    LayerPath,
    TrackingCheck,
    format_check,
    tracked_layer_path,
)

__all__ = [
    "FALLBACK",
    "REFUSED",
    "UNKNOWN",
    "LayerPath",
    "TrackingCheck",
    "check",
    "format_check",
]


def check(
    model: Any, x: Any, forms: dict[str, str] | None, y: Any, sample_weight: Any
) -> TrackingCheck:
    """`kgt.check` on TensorFlow (`keras_gradtrack/checking.py`): the forward pass traced
    once with the taps on symbolic inputs, a batch's guard and traced step, nothing run;
    `forms`, those of a traced tracked step, are shown instead of the predicted ones."""
    if not hasattr(model, "tracked_gradient"):
        raise TypeError(
            "Expected a Keras model with GradientTrackingMixin (kgt.GradientTrackingModel, "
            f"kgt.GradientTrackingSequential). Received: {type(model).__name__}"
        )
    batch = x is not None and has_values(x)
    if not model.built and batch:
        build_from(model, x)
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built yet; call it on a batch or `build()` it "
            "before checking how its layers will be tracked (or pass a batch: "
            "`kgt.check(model, x=...)`)."
        )
    plan = tracked_layers(model)
    specs = input_specs(model, x)
    traced = trace_forward(model, plan, specs) if specs is not None else {}
    model_refusals = []
    try:
        checks.refuse_activation_losses(model)
    except ValueError as error:
        model_refusals.append(str(error))
    if getattr(model, "steps_per_execution", 1) > 1:
        refusal = steps_per_execution_refusal(model)
        if refusal:
            model_refusals.append(refusal)
    if batch:
        model_refusals.extend(batch_refusals(model, x, y, sample_weight, model_refusals))
    opted_in = getattr(model, "track_batch_normalization", False)
    rows = []
    for column, tracked in enumerate(plan):
        form, refusal, note = traced.get(tracked.name, (UNKNOWN, "", ""))
        refusal = example_mixing_refusal(tracked.layer, opted_in) or refusal
        if forms and tracked.name in forms:
            form = forms[tracked.name]
        rows.append(layer_path(column, tracked, form, refusal, note))
    unknown_sizes = specs is not None and any(
        None in spec.shape[1:] for spec in tree.flatten(specs)
    )
    return TrackingCheck(tuple(rows), tuple(model_refusals), specs is not None, unknown_sizes)


def has_values(x: Any) -> bool:
    """Whether `x` holds values (arrays, tensors), not only `tf.TensorSpec`s."""
    leaves = [leaf for leaf in tree.flatten(x) if leaf is not None]
    return bool(leaves) and not any(isinstance(leaf, tf.TensorSpec) for leaf in leaves)


def build_from(model: Any, x: Any) -> None:
    """Builds an unbuilt model by calling it on one example of `x` in inference mode;
    its states are left as they were."""
    inputs, _ = split_example_ids(x, validate=False)
    with states_restored(model):
        model(rows(inputs, 1), training=False)


def batch_refusals(model: Any, x: Any, y: Any, sample_weight: Any, known: list[str]) -> list[str]:
    """What the first tracked step of `fit` on this batch would refuse beyond the layers':
    the example-independence guard, then the tracked step's own trace."""
    inputs, _ = split_example_ids(x, validate=False)
    found = []
    if getattr(model, "check_example_independence", True):
        mixing = find_example_mixing(model, inputs, y, sample_weight)
        if mixing is not None:
            found.append(str(mixing_error(model, mixing)))
    if not found and not known:
        refusal = traced_step_refusal(model, x, y, sample_weight)
        if refusal:
            found.append(refusal)
    return found


def traced_step_refusal(model: Any, x: Any, y: Any, sample_weight: Any) -> str:
    """The error the tracked step raises when traced on this batch ("" if none).

    The model's own `train_step` is traced (nothing runs), with the optimizer's
    update left out of the trace: no variable changes.
    """
    if y is None and getattr(model, "compiled_loss", None) is not None and not has_own_step(model):
        return ""  # the loss' checks need the targets
    data = tree.map_structure(
        lambda value: None if value is None else tf.convert_to_tensor(value),
        keras.utils.pack_x_y_sample_weight(x, y, sample_weight),
    )
    defaults = statistics.resolve(None)
    optimizer = getattr(model, "optimizer", None)

    def step(data: Any) -> Any:
        return model._tracked_step(data, defaults)

    try:
        with optimizer_updates_left_out(optimizer):
            tf.function(step, autograph=False).get_concrete_function(data)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        return str(error).strip()
    return ""


def has_own_step(model: Any) -> bool:
    """Whether the model's class defines a `train_step` of its own."""
    return type(model).train_step.__qualname__ != "GradientTrackingMixin.train_step"


@contextlib.contextmanager
def optimizer_updates_left_out(optimizer: Any) -> Iterator[None]:
    """The optimizer's `apply` and `apply_gradients` as no-ops for the block."""
    if optimizer is None:
        yield
        return
    with patched_each((optimizer, name, _no_update) for name in ("apply", "apply_gradients")):
        yield


def _no_update(*args: Any, **kwargs: Any) -> None:
    return None


def steps_per_execution_refusal(model: Any) -> str:
    """Why `model`'s `steps_per_execution > 1` cannot be tracked, or "" if it can."""
    steps = model.steps_per_execution
    if getattr(model, "privacy_settings", None) is not None:
        return clipping.steps_per_execution_refusal(steps)
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas > 1:
        return multi_replica_steps_refusal(steps, replicas)
    return ""


def multi_replica_steps_refusal(steps: int, replicas: int) -> str:
    return (
        "A tracked model runs `steps_per_execution > 1` on one replica only; this "
        f"strategy has {replicas}. Compile with `steps_per_execution=1` under a "
        f"multi-replica tf.distribute strategy. Received: steps_per_execution={steps}"
    )


def layer_path(column: int, tracked: TrackedLayer, form: str, refusal: str, note: str) -> LayerPath:
    if refusal:
        path, form = REFUSED, UNKNOWN
    elif tracked.rule is None:
        # Before a BatchNormalization in training, even a fallback layer's rows are coupled.
        path, form = FALLBACK, COUPLED if form == COUPLED else JACOBIAN
    else:
        path = tracked.path
    notes = [n for n in (tracked.reason, note) if n]
    return tracked_layer_path(column, tracked, path, form, "; ".join(notes), refusal)


def input_specs(model: Any, x: Any = None) -> Any:
    """`tf.TensorSpec`s of the model's inputs (batch size unknown), or None if unknown."""
    if x is not None:
        x, _ = split_example_ids(x, validate=False)
        return tree.map_structure(spec_of, x)
    inputs = functional_inputs(model)
    if inputs is not None:
        return tree.map_structure(spec_of, inputs)
    # A subclassed model called once on one tensor remembers its shape (not its dtype).
    shapes = build_shapes(model)
    if len(shapes) == 1 and is_shape(shapes[0]):
        return tf.TensorSpec([None, *shapes[0][1:]], tf.float32)
    return None


def is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(
        size is None or isinstance(size, int) for size in value
    )


def spec_of(value: Any) -> tf.TensorSpec:
    return tf.TensorSpec([None, *value.shape[1:]], value.dtype)


def trace_forward(model: Any, plan: Plan, specs: Any) -> dict[str, tuple[str, str, str]]:
    """`{column name: (form, refusal, note)}` from one symbolic trace of the forward pass."""
    found: dict[str, tuple[str, str, str]] = {}

    def forward(inputs: Any) -> None:
        with TrackingContext(model, plan, (), None, batch=inputs) as context:
            model(inputs, training=True)  # Keras drops it where `call` has none
            context.stop_recording()
        graph, forward_ops = context.forward.graph, context.forward.range
        # Layers before a BatchNormalization in training (model.track_batch_normalization).
        coupled = coupled_layer_names(context.coupling, plan)
        mixing = {
            id(layer): str(error)
            for layer, error in rows_mixing_errors(context.taps, forward_ops, context.batch)
        }
        for tracked, tap in zip(plan, context.taps):
            recorded = tuple(tap.recorded)
            if not recorded:
                found[tracked.name] = (UNKNOWN, "", "not called in the forward pass")
                continue
            refusal = mixing.get(id(tracked.layer), "")
            calls = tuple(call.call for call in recorded)
            try:
                checks.refuse_calls_inside_loops([tracked], [recorded], graph)
                checks.refuse_tied_variables(
                    [tracked], [[call.graph_ops for call in recorded]], forward_ops
                )
            except ValueError as error:
                refusal = refusal or str(error)
            form = UNKNOWN
            if not refusal:
                (form,) = layer_forms((tracked,), [calls], coupled)
            notes = []
            if any(call.batchless for call in recorded):
                notes.append("inputs do not depend on the batch: the call is broadcast to it")
            if form == MATERIALIZED and tracked.rule is not None and tracked.rule.kernels:
                notes.append(tracked.rule.kernels(tracked.layer, calls))
            note = "; ".join(notes)
            found[tracked.name] = (form, refusal, note)

    tf.function(forward, autograph=False).get_concrete_function(specs)
    return found
