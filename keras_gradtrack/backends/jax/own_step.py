"""A model's own `train_step` on JAX: `tracked_value_and_grad` in place of `jax.value_and_grad`.

Keras' JAX `train_step(self, state, data)` is stateless: it differentiates a
function of the trainable variables' values (usually `compute_loss_and_updates`)
with `jax.value_and_grad`, applies the gradients with
`optimizer.stateless_apply` and returns `(logs, state)`. A model with its own
step calls `self.tracked_value_and_grad(fun, argnums=0, has_aux=False)` where
it would call `jax.value_and_grad(fun, ...)`: on untracked steps it is
`jax.value_and_grad` itself; on a tracked step the same differentiation runs
with a zero probe on each tracked layer's output and on the values each Keras
loss reduces (`losses.py`), returns the same value and gradients, and hands the
statistics to the step, which adds them to the logs the `train_step` returns. A
step that calls `super().train_step(state, data)` instead reaches Keras' step
through the mixin (`keras_step`), which on a tracked step runs the engine's
tracked version of it.

On a private model's step (`private=`), the gradients `tracked_value_and_grad`
returns (or that `super().train_step` applies) are the private ones
(`private_step.py`, times the loss scale as the optimizer expects), and the step's
logs gain `dp_fraction_clipped` (and the adaptive bound), as on TensorFlow, where
`tracked_gradient` returns them. The weight penalties' part is read from the
function's own loss (`penalties.py`).

Example:

```python
def train_step(self, state, data):
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    grad_fn = self.tracked_value_and_grad(self.compute_loss_and_updates, has_aux=True)
    (loss, aux), grads = grad_fn(trainable, non_trainable, metrics_variables, x, y, ...)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_gradtrack._keras_seam import update_metrics_variables
from keras_gradtrack.backends.jax.batchless import batchless_calls
from keras_gradtrack.backends.jax.coupled import step_coupling
from keras_gradtrack.backends.jax.losses import loss_factor, recording_losses
from keras_gradtrack.backends.jax.opt_in import InputProbes, needs_input_gradients
from keras_gradtrack.backends.jax.penalties import probing_penalties, regularized_variables
from keras_gradtrack.backends.jax.plan import BACKEND
from keras_gradtrack.backends.jax.probes import Probes
from keras_gradtrack.backends.jax.rules import fallback_per_example
from keras_gradtrack.backends.jax.step import (
    JAX,
    learning_rate,
    recording_added_losses,
    tracked_train_step,
)
from keras_gradtrack.backends.ops.loss_scale import loss_scale_of, recording_loss_scale, unscaled
from keras_gradtrack.backends.ops.payload import columns_and_payload
from keras_gradtrack.backends.ops.step import (
    ProbedPass,
    Tracking,
    batch_size_of,
    one_loss_of_one_output,
)
from keras_gradtrack.engine.reductions import LossRecorder, per_example_shares
from keras_gradtrack.engine.refusals import uncalled_names
from keras_gradtrack.engine.schedule import PAYLOAD_KEY
from keras_gradtrack.io.schema import LEARNING_RATE

# Where a tracked step of the model's own `train_step` leaves its `OwnStepTracking`
# (in the model's `__dict__`, while the step is traced).
TRACKING_KEY = "_own_step_tracking"


@dataclasses.dataclass
class OwnStepTracking:
    """One tracked step of a model's own `train_step`: what `tracked_value_and_grad`
    needs, and the payload it leaves.

    Attributes:
        tracking: What the step computes.
        state: The step's state (the non-trainable values the rules read).
        batch: The batch size.
        payload: The statistics (and the requests' rows), once
            `tracked_value_and_grad` has run.
        rows: The private step's values for the logs, once it has run.
        batchless: Positions (in call order) of the probed calls whose input does not
            follow the batch (`batchless.py`).
        recording: Whether this run of the step only records the inputs of the probed
            calls (`inputs`): `tracked_value_and_grad` is then `jax.value_and_grad`.
        inputs: The first argument of each probed call, when recording.
    """

    tracking: Tracking
    state: Any
    batch: int
    payload: dict[str, Any] | None = None
    rows: dict[str, Any] = dataclasses.field(default_factory=dict)
    batchless: frozenset[int] = frozenset()
    recording: bool = False
    inputs: list[Any] = dataclasses.field(default_factory=list)


def own_tracked_step(
    model: keras.Model, tracking: Tracking, state: Any, data: Any
) -> tuple[dict[str, Any], Any]:
    """The model's own `train_step`, whose logs also carry the statistics (and the
    rows of the attribution requests) under `PAYLOAD_KEY` (from its call of
    `tracked_value_and_grad`); for a private model, the private step's values too.

    Raises:
        NotImplementedError: When the step did not call `tracked_value_and_grad`.
    """

    def run(own: OwnStepTracking, data: Any) -> Any:
        model.__dict__[TRACKING_KEY] = own
        try:
            return model.train_step(state, data)
        finally:
            model.__dict__.pop(TRACKING_KEY, None)

    def probed_inputs(data: Any) -> list[Any]:
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        recording = OwnStepTracking(tracking, state, batch_size_of(x), recording=True)
        run(recording, data)
        return recording.inputs

    # Only the step knows which of its values are the batch: two abstract traces of
    # it, at the batch and at one example more, find the calls that do not follow it.
    batchless = batchless_calls(probed_inputs, data)
    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    own = OwnStepTracking(tracking, state, batch_size_of(x), batchless=batchless)
    logs, state = run(own, data)
    if own.payload is None:
        raise NotImplementedError(
            f"The train_step of {type(model).__name__} (a model's own train_step) did not "
            "call `self.tracked_value_and_grad(fun, ...)` (nor this mixin's "
            "`super().train_step(state, data)`), so this tracked step has no "
            f"per-example statistics on the {BACKEND} backend. Call it where the step "
            "calls `jax.value_and_grad(fun, ...)` (it returns the same values and "
            "gradients); see GradientTrackingMixin.tracked_value_and_grad."
        )
    return {**logs, **own.rows, PAYLOAD_KEY: own.payload}, state


def keras_step(
    model: keras.Model, state: Any, data: Any, keras_train_step: Callable[..., Any]
) -> tuple[dict[str, Any], Any]:
    """Keras' own `train_step`, reached by a model's own step through
    `super().train_step(state, data)`: on a tracked step, `tracked_train_step` (the
    same update, plus the statistics it leaves for the step); otherwise
    `keras_train_step`, Keras' step itself."""
    own = model.__dict__.get(TRACKING_KEY)
    if own is None or own.recording:
        # Recording: Keras' tracked step finds the batchless calls of its own.
        return keras_train_step(state, data)
    if own.payload is not None:
        raise ValueError(
            "`super().train_step` ran after `tracked_value_and_grad` (or twice) in one "
            "tracked step; the step's statistics come from one differentiation of the loss."
        )
    tracking = own.tracking
    if tracking.private is not None:
        private_gradients = tracking.private

        def private(*args: Any) -> Any:
            gradients, own.rows = private_gradients(*args)
            return gradients, own.rows

        tracking = dataclasses.replace(tracking, private=private)
    logs, state = keras_tracked_step(model, tracking, state, data)
    logs = dict(logs)
    own.payload = logs.pop(PAYLOAD_KEY)
    return logs, state


def tracked_value_and_grad(
    model: keras.Model, fun: Callable[..., Any], argnums: int = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """`jax.value_and_grad(fun, argnums, has_aux)`, which on a tracked step of the
    model's own `train_step` also computes the step's statistics (see the module)."""
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def value_and_grad(*args: Any, **kwargs: Any) -> Any:
        own = model.__dict__.get(TRACKING_KEY)
        if own is None:
            return plain(*args, **kwargs)
        if own.recording:
            probes = Probes([tracked.layer for tracked in own.tracking.plan])
            with probes.installed(None, frozenset(), own.batch):
                result = plain(*args, **kwargs)
            own.inputs = [call_inputs for _, call_inputs, _ in probes.calls]
            return result
        if argnums != 0 or not args:
            raise ValueError(
                "On a tracked step, `tracked_value_and_grad` differentiates with respect "
                "to its function's first argument, the values of the model's trainable "
                f"variables (`state[0]`). Received: argnums={argnums!r}"
            )
        if own.payload is not None:
            raise ValueError(
                "`tracked_value_and_grad` ran twice in one tracked step; the step's "
                "statistics come from one differentiation of the loss."
            )
        result, own.payload = tracked_call(model, own, fun, has_aux, args, kwargs)
        return result

    return value_and_grad


def tracked_call(
    model: keras.Model,
    own: OwnStepTracking,
    fun: Callable[..., Any],
    has_aux: bool,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    data: Any = None,
    arguments_of: Callable[[Any], Sequence[Any]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """`(value_and_grad's result, payload)`: `fun` differentiated with respect to its
    first argument, the probes and the loss probes, in one `jax.value_and_grad`.

    With the step's `data` and `arguments_of` (data -> `args` without the first),
    layer calls on values that do not depend on the batch are made on them broadcast
    to it (`batchless.py`)."""
    trainable, rest = args[0], args[1:]
    expected = [tuple(v.shape) for v in model.trainable_variables]
    if not isinstance(trainable, (list, tuple)) or [tuple(t.shape) for t in trainable] != expected:
        raise ValueError(
            "On a tracked step, `tracked_value_and_grad`'s function takes the values of "
            "the model's trainable variables (`state[0]`, in the order of "
            f"`model.trainable_variables`) as its first argument. Expected shapes {expected}. "
            f"Received: {type(trainable).__name__} {trainable!r:.200}"
        )
    tracking = own.tracking
    probes = Probes([tracked.layer for tracked in tracking.plan])
    input_probes = InputProbes(model, needs_input_gradients(tracking.statistics))
    recorders: list[LossRecorder] = []

    batchless = own.batchless

    def forward(
        trainable: Any,
        probe_values: Any,
        loss_probes: Any,
        penalty_probes: Any = None,
        rest: Sequence[Any] = rest,
    ) -> Any:
        layer_values, input_values = probe_values or (None, None)
        with (
            probes.installed(layer_values, batchless, own.batch),
            input_probes.installed(input_values),
            recording_losses(loss_probes) as recorder,
            recording_loss_scale(model.optimizer) as scales,
            probing_penalties(model, penalty_probes),
        ):
            outputs = fun(trainable, *rest, **kwargs)
        recorders.append(recorder)
        value, aux = outputs if has_aux else (outputs, None)
        inputs = [call_inputs for _, call_inputs, _ in probes.calls]
        recorded = [(r.values, r.weight_sum) for r in recorder.records]
        probed = (list(probes.probed), list(input_probes.probed))
        return value, (aux, inputs, probed, recorded, loss_scale_of(scales), probes.call_tensors())

    if arguments_of is not None:
        batchless = batchless_calls(
            lambda data: forward(trainable, None, None, None, arguments_of(data))[1][1], data
        )
    # A first trace records the shapes of the probed outputs and of the loss values,
    # and the losses the model's calls add (weight penalties, `add_loss`).
    with recording_added_losses(model) as added_losses:
        _, (_, _, probed_shapes, recorded_shapes, _, _) = jax.eval_shape(
            lambda t: forward(t, None, None), trainable
        )
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), probed_shapes)
    loss_zeros = [jnp.zeros(values.shape, values.dtype) for values, _ in recorded_shapes]
    # A private step reads the weight with which the loss holds each penalty.
    penalized = regularized_variables(model) if tracking.private is not None else []
    penalty_zeros = [jnp.zeros((), jnp.float32) for _ in penalized]
    (value, (aux, inputs, _, recorded, scale, tensors)), gradients = jax.value_and_grad(
        forward, argnums=(0, 1, 2, 3), has_aux=True
    )(trainable, zeros, loss_zeros, penalty_zeros)
    calls = probes.call_kwargs(tensors)
    grads, (probe_grads, input_grads), loss_grads, penalty_weights = gradients
    uncalled = uncalled_names(tracking.plan, {index for index, _ in calls})
    if uncalled:
        raise ValueError(
            f"The function given to `tracked_value_and_grad` did not call the tracked "
            f"layers {uncalled}, so their per-example gradients are not defined on this "
            "step: differentiate a function that runs the model (`self.stateless_call` or "
            "`self.compute_loss_and_updates`)."
        )
    recorder = recorders[-1]
    records = [
        dataclasses.replace(record, values=values, weight_sum=weight_sum)
        for (values, weight_sum), record in zip(recorded, recorder.records)
    ]
    factor = loss_factor(LossRecorder(records, recorder.refused, recorder.whole_batch), own.batch)
    # The statistics are the unscaled loss's; the optimizer receives `grads` as they are.
    losses = per_example_shares(records, unscaled(loss_grads, scale)) / factor
    probed = ProbedPass(
        calls,
        inputs,
        unscaled(probe_grads, scale),
        trainable,
        own.state[1],
        unscaled(grads, scale),
        fallback_per_example,
        unscaled(input_grads, scale),
    )
    # Through BatchNormalization in training (opted in): `l` as a function of the
    # trainable values is each example's share of the recorded losses, with the
    # backward pass's `dL/dv` held fixed (the shares' weights: as on TensorFlow).
    cotangents = jax.lax.stop_gradient(unscaled(loss_grads, scale))

    def coupled_losses(trainable: Any) -> Any:
        recorded = forward(trainable, None, None)[1][3]
        shares = [
            dataclasses.replace(record, values=values, weight_sum=weight_sum)
            for (values, weight_sum), record in zip(recorded, recorder.records)
        ]
        return per_example_shares(shares, cotangents) / factor

    coupling = step_coupling(
        model,
        tracking.plan,
        lambda t: forward(t, None, None),
        coupled_losses,
        trainable,
        probed.grads,
    )
    # The function may add terms of its own (penalties) to `c sum_i l_i`: the rules
    # sum the per-example gradients rather than take `sum_i g_i` from `G`.
    optimizer_variables = own.state[2]
    parts = (factor, None, coupling, JAX)
    columns, payload = columns_and_payload(model, tracking, probed, losses, *parts)
    payload[LEARNING_RATE] = learning_rate(model, optimizer_variables)
    if tracking.private is not None:
        # After the statistics: they read the step's adaptive bound before its update.
        arguments = (columns, factor, added_losses, optimizer_variables, scale)
        private_grads, own.rows = tracking.private(
            model, tracking.plan, probed, *arguments, unscaled(penalty_weights, scale)
        )
        grads = type(grads)(private_grads)
    result = ((value, aux) if has_aux else value), grads
    return result, payload


def recorded_losses_step(
    model: keras.Model, tracking: Tracking, state: Any, data: Any
) -> tuple[dict[str, Any], Any]:
    """Keras' JAX `train_step` with `tracked_value_and_grad` in place of
    `jax.value_and_grad`: the per-example losses are those of the Keras losses the
    model's `compute_loss` reduces (recorded), for a model whose `compute_loss` is
    its own (keras-io's knowledge distillation, say)."""
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    own = OwnStepTracking(tracking, state, batch_size_of(x))

    def arguments_of(data: Any) -> tuple[Any, ...]:
        return (non_trainable, metrics_variables, *keras.utils.unpack_x_y_sample_weight(data))

    arguments = (trainable, *arguments_of(data))
    options = {"training": True, "optimizer_variables": optimizer_variables}
    ((_, aux), grads), payload = tracked_call(
        model,
        own,
        model.compute_loss_and_updates,
        True,
        arguments,
        options,
        data,
        arguments_of,
    )
    unscaled_loss, y_pred, non_trainable, metrics_variables = aux
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    logs, metrics_variables = update_metrics_variables(
        model, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )
    state = (trainable, non_trainable, optimizer_variables, metrics_variables)
    return {**logs, **own.rows, PAYLOAD_KEY: payload}, state


def keras_tracked_step(
    model: keras.Model, tracking: Tracking, state: Any, data: Any
) -> tuple[dict[str, Any], Any]:
    """The tracked version of Keras' own `train_step` for the model: with Keras'
    `compute_loss` and one unweighted loss of one output, `tracked_train_step` (the
    compiled loss split into examples); with several outputs, several losses, loss
    weights, or a `compute_loss` of the model's own, `recorded_losses_step` (the
    Keras losses that `compute_loss` reduces, recorded: loss weights included)."""
    keras_compute_loss = type(model).compute_loss is keras.Model.compute_loss
    # Decided when traced: the targets show whether the batch has several outputs.
    if keras_compute_loss and one_loss_of_one_output(model, data):
        return tracked_train_step(model, tracking, state, data)
    return recorded_losses_step(model, tracking, state, data)
