"""The tracked train step on JAX: Keras' own step, plus the statistics from its one backward pass.

`jax.value_and_grad` differentiates Keras' `compute_loss_and_updates` with respect
to the trainable variables and to a zero probe on each tracked layer's
(pre-activation) output (`probes.py`); the layers' inputs come back as auxiliary
outputs. The optimizer receives the variables' gradients, exactly as in Keras'
`train_step`; the probes' gradients, divided by the loss's reduction factor (and
by the loss scale, `loss_scale.py`), are the per-example output gradients the rules
need. The opt-in statistics add a probe on the model's inputs and Gram matrices
(`opt_in.py`).

Example:

```python
logs, state = tracked_train_step(model, Tracking(plan, statistics), state, data)
logs[PAYLOAD_KEY]["cosine"]     # (B,)
```
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_gradtrack._keras_seam import update_metrics_variables
from keras_gradtrack._patching import patched
from keras_gradtrack.backends.jax.attribution import target_calls
from keras_gradtrack.backends.jax.batchless import batchless_calls
from keras_gradtrack.backends.jax.coupled import Coupling, step_coupling
from keras_gradtrack.backends.jax.opt_in import InputProbes, needs_input_gradients
from keras_gradtrack.backends.jax.probes import Probes
from keras_gradtrack.backends.jax.rules import f32, fallback_per_example
from keras_gradtrack.backends.ops.loss_scale import loss_scale_of, recording_loss_scale, unscaled
from keras_gradtrack.backends.ops.payload import columns_and_payload
from keras_gradtrack.backends.ops.protocol import Backend
from keras_gradtrack.backends.ops.step import (
    ProbedPass,
    Tracking,
    batch_size_of,
    per_example_losses,
)
from keras_gradtrack.engine.schedule import PAYLOAD_KEY
from keras_gradtrack.io.schema import LEARNING_RATE

JAX = Backend(fallback_per_example, target_calls)


def tracked_train_step(
    model: keras.Model, tracking: Tracking, state: Any, data: Any
) -> tuple[dict[str, Any], Any]:
    """Keras' JAX `train_step`, whose logs also carry the statistics (and the rows of
    the attribution requests, by key) under `PAYLOAD_KEY`; for a private model, its
    optimizer receives the private gradients, and the logs their values.

    `data` holds no example ids (`split_example_ids` takes them off first, outside
    the compiled step, so that int64 ids stay exact).
    """
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    plan = tracking.plan
    probes = Probes([tracked.layer for tracked in plan])
    input_probes = InputProbes(model, needs_input_gradients(tracking.statistics))

    batch = batch_size_of(x)
    batchless: frozenset[int] = frozenset()

    def forward(trainable: Any, probe_values: Any, data: Any = data) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        layer_values, input_values = probe_values or (None, None)
        with (
            probes.installed(layer_values, batchless, batch),
            input_probes.installed(input_values),
            recording_loss_scale(model.optimizer) as scales,
        ):
            loss, aux = model.compute_loss_and_updates(
                trainable,
                non_trainable,
                metrics_variables,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_variables,
            )
        inputs = [call_inputs for _, call_inputs, _ in probes.calls]
        probed = (list(probes.probed), list(input_probes.probed))
        return loss, (aux, inputs, probed, loss_scale_of(scales), probes.call_tensors())

    # Calls on values that do not depend on the batch are made on them broadcast to it.
    batchless = batchless_calls(lambda data: forward(trainable, None, data)[1][1], data)
    # A first trace records the probed shapes, and whether the forward pass adds
    # losses of its own (weight penalties, `add_loss`) to the examples' losses.
    with recording_added_losses(model) as added_losses:
        shapes = jax.eval_shape(lambda t: forward(t, None), trainable)[1][2]
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (_, (aux, inputs, _, scale, tensors)), (grads, (probe_grads, input_grads)) = jax.value_and_grad(
        forward, argnums=(0, 1), has_aux=True
    )(trainable, zeros)
    calls = probes.call_kwargs(tensors)
    unscaled_loss, y_pred, new_non_trainable, new_metrics_variables = aux
    losses, factor = per_example_losses(model, y, y_pred, sample_weight)
    # The statistics are the unscaled loss's; the optimizer receives `grads` as Keras' step.
    probed = ProbedPass(
        calls,
        inputs,
        unscaled(probe_grads, scale),
        trainable,
        non_trainable,
        unscaled(grads, scale),
        fallback_per_example,
        unscaled(input_grads, scale),
    )
    # Seen to add no losses, the loss is `c sum_i l_i`, so `sum_i g_i = G / c`.
    exact_factor = factor if added_losses == [0] else None
    # Through BatchNormalization in training (opted in): the rows of the losses' Jacobian,
    # from the step's own forward pass (its aux: the unscaled loss, then `y_pred`).
    coupling = step_coupling(
        model,
        plan,
        lambda t: forward(t, None),
        lambda t: per_example_losses(model, y, forward(t, None)[1][0][1], sample_weight)[0],
        trainable,
        grads,
    )
    # The batch gradient of each layer with materialized per-example gradients is their
    # sum (for the optimizer too, times the loss scale), unless the step is private.
    sums: dict[int, Any] | None = {} if tracking.private is None else None
    parts = (factor, exact_factor, coupling or Coupling(), JAX, sums)
    columns, payload = columns_and_payload(model, tracking, probed, losses, *parts)
    payload[LEARNING_RATE] = learning_rate(model, optimizer_variables)
    if sums:
        grads = summed_gradients(model, grads, sums, scale)
    rows: dict[str, Any] = {}
    if tracking.private is not None:
        # After the statistics: they read the step's adaptive bound before its update.
        grads, rows = tracking.private(
            model, plan, probed, columns, factor, added_losses, optimizer_variables, scale
        )
    new_trainable, new_optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    logs, new_metrics_variables = update_metrics_variables(
        model, new_metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )
    state = (new_trainable, new_non_trainable, new_optimizer_variables, new_metrics_variables)
    return {**logs, **rows, PAYLOAD_KEY: payload}, state


def summed_gradients(
    model: keras.Model, grads: Sequence[Any], sums: Mapping[int, Any], scale: Any
) -> list[Any]:
    """`grads` (the loss-scaled batch gradient, per trainable variable) with the
    unscaled `sums` (by variable id) in place, times the loss scale `scale` (or None)."""
    found = []
    for variable, gradient in zip(model.trainable_variables, grads):
        value = sums.get(id(variable))
        if value is not None:
            value = value if scale is None else value * scale
            gradient = value.astype(gradient.dtype)
        found.append(gradient)
    return found


@contextlib.contextmanager
def recording_added_losses(model: keras.Model) -> Iterator[list[int]]:
    """Records, per `model.stateless_call(..., return_losses=True)` in the block, how
    many losses it returns (weight penalties, `add_loss` terms)."""
    added_losses: list[int] = []
    stateless_call = model.stateless_call

    def recording_stateless_call(*args: Any, **kwargs: Any) -> Any:
        outputs = stateless_call(*args, **kwargs)
        if kwargs.get("return_losses"):
            added_losses.append(len(outputs[-1]))
        return outputs

    with patched(model, "stateless_call", recording_stateless_call):
        yield added_losses


Layout = tuple[tuple[str, tuple[int, ...]], ...]


def packed(payload: dict[str, Any]) -> tuple[Any, Layout]:
    """The payload as one float32 vector (one transfer to the host instead of one per
    statistic), and its layout; in the compiled step."""
    layout = tuple((name, tuple(value.shape)) for name, value in payload.items())
    vector = jnp.concatenate([f32(value).reshape(-1) for value in payload.values()])
    return vector, layout


class Layouts:
    """The payload layout of each trace of a compiled step, by the shapes of its data.

    A step is traced once per shape of its batch (a short last batch is a second
    trace), and each trace packs its payload with its own layout: each step's
    vector is unpacked with the layout of the trace that ran it.

    Example:

    ```python
    layouts = Layouts()

    def step(state, data):
        ...
        vector, layout = packed(payload)
        layouts.record(data, layout)    # when traced
        return vector

    unpacked(jax.jit(step)(state, data), layouts.of(data))
    ```
    """

    def __init__(self) -> None:
        self._by_shapes: dict[Any, Layout] = {}

    def __contains__(self, data: Any) -> bool:
        return self.key(data) in self._by_shapes

    @staticmethod
    def key(data: Any) -> Any:
        leaves, structure = jax.tree_util.tree_flatten(data)
        return structure, tuple(tuple(np.shape(leaf)) for leaf in leaves)

    def record(self, data: Any, layout: Layout) -> None:
        self._by_shapes[self.key(data)] = layout

    def of(self, data: Any) -> Layout:
        return self._by_shapes[self.key(data)]


def unpacked(vector: Any, layout: Layout) -> dict[str, np.ndarray]:
    """The payload's arrays (views of `vector`), on the host."""
    values, offset = {}, 0
    flat = np.asarray(vector)
    for name, shape in layout:
        size = math.prod(shape)
        values[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return values


def learning_rate(model: keras.Model, optimizer_variables: Any) -> Any:
    """The rate the optimizer uses in this step (its schedule at the step's iteration)."""
    optimizer = model.optimizer
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_variables))):
        return f32(keras.ops.convert_to_tensor(optimizer.learning_rate))
