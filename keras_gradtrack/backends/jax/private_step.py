"""The private step on JAX (DP-SGD): clipped per-example gradients, summed, plus noise.

For a model made private (`make_private`), the tracked step (`step.py`) hands the
optimizer, in place of the batch gradient,

    (sum_i min(1, C / ||g_i||) g_i + N(0, sigma^2 C^2 I)) / B_expected

from its one `jax.value_and_grad` with the probes, as the TensorFlow engine does
(`engine/clipping.py`). The norms, the clipping weights, each layer's clipped sum and
the noised sum over `B_expected` are the shared `backends/ops/private_step.py`
(PyTorch's too); what is JAX's:

* each layer's local vector-Jacobian product (`local_vjp`, `jax.vjp` of the layer's
  pre-activation output at the recorded inputs), and its `vmap(grad)` fallback;
* the noise `N(0, (sigma C)^2)`, one `jax.random.normal` for every variable
  (`one_draw`: one kernel for XLA to compile), from the base seed of `make_private`
  folded with the optimizer's step count (so a run is reproducible), and the sum divided by `B_expected` (else the batch); with
  `accumulation_steps=k` (Keras' `gradient_accumulation_steps`, which applies the
  mean of k physical batches' gradients) each physical batch's sum goes over
  `B_expected / k` and the noise is drawn on the k-th alone;
  with `secure_noise=True` the draw is `secure_noise.py`'s (host, `os.urandom`);
* weight penalties (`variable.regularizer`) do not depend on the data: their
  gradient is added unclipped and without noise (in a function of one's own, with
  the weight its loss gives each: `penalties.py`). Other added losses (`add_loss`,
  activity regularizers) are refused, as on TensorFlow;
* with a loss scale `s` (a `LossScaleOptimizer`, `mixed_float16`, an optimizer's
  `loss_scale_factor`), the norms and weights are the unscaled gradients' (in
  float32), each layer's product runs on the scaled output gradients `s w_i d_i`
  (as the backward pass holds them: float16 keeps its range) and is unscaled after,
  and the optimizer receives `s` times the update, which it unscales (skipping a
  step whose gradients are not finite), as on TensorFlow (`engine/clipping.py`);
* with adaptive clipping (`privacy/adaptive_clip.py`) the bound `C_t` is the value
  of a non-trainable Keras variable of the model (`BOUND_KEY`), which the compiled
  step reads and updates in a `keras.StatelessScope` (its value goes in and out
  with the step's state: `JaxPrivateTraining._compiled_with_private_state`); the
  count of unclipped examples is noised with the draw after the variables'
  (position `len(trainable)`), as on TensorFlow.

Example:

```python
tracking = Tracking(plan, statistics, private=private_gradients)
logs, state = tracked_train_step(model, tracking, state, data)
logs["dp_fraction_clipped"]
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_gradtrack._keras_seam import optimizer_apply_count
from keras_gradtrack.backends.jax.plan import BACKEND, TrackedLayer
from keras_gradtrack.backends.jax.rules import f32, fallback_per_example
from keras_gradtrack.backends.jax.secure_noise import secure_standard_normal
from keras_gradtrack.backends.ops import private_step as shared
from keras_gradtrack.backends.ops.private_model import BOUND_KEY
from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.engine.private_settings import PrivacySettings, settings_of


def private_gradients(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    probed: Any,
    columns: Sequence[Any],
    factor: Any,
    added_losses: Sequence[int],
    optimizer_variables: Any,
    loss_scale: Any = None,
    penalty_weights: Sequence[Any] | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """`(gradients, rows)`: what the optimizer receives (aligned with
    `model.trainable_variables`) and the values for fit's logs.

    With adaptive clipping, call it in a `keras.StatelessScope` mapping the bound's
    variable (`BOUND_KEY`) to its value: it reads `C_t` there and assigns `C_{t+1}`.

    Args:
        model: The private model.
        plan: Its tracked layers.
        probed: The step's `ProbedPass`.
        columns: Per tracked layer, its primitives and `||G^(k)||^2`.
        factor: `c`, with which the loss reduces the examples' losses.
        added_losses: How many losses the forward pass added to the compiled loss
            (as the step's first trace saw them).
        optimizer_variables: The optimizer's values before the step (its step count).
        loss_scale: `s`, the loss scale of the step's gradients (float32), or None.
        penalty_weights: The weight of each penalty in the loss, for a function of
            the model's own (`penalty_gradients`); None: Keras' step.

    Raises:
        ValueError: When the forward pass adds losses other than weight penalties
            (`add_loss`, activity regularizers), or a trainable variable is in no
            tracked layer.
    """
    settings = settings_of(model)
    assert settings is not None
    penalties = penalty_gradients(model, probed.trainable, added_losses, penalty_weights)
    noised: Any = True
    k = settings.accumulation_steps
    if k > 1:  # only the k-th physical batch carries the logical batch's noise
        applies = optimizer_value(model, optimizer_variables, optimizer_apply_count)
        noised = (applies + 1) % k == 0
    key = step_key(model, settings.seed, optimizer_variables)
    if settings.secure_noise:

        def draw(position: int, shape: tuple[int, ...], scale: Any) -> Any:
            return secure_standard_normal(shape, scale)

    else:
        draw = one_draw(key, [tuple(v.shape) for v in model.trainable_variables])

    bound = step_bound(model, settings)  # this step's C (adaptive: before its update)
    step = shared.BackendStep(bound, penalties, local_vjp, fallback_per_example, draw, noised)
    return shared.private_gradients(step, model, plan, probed, columns, factor, loss_scale)


def one_draw(key: Any, shapes: Sequence[tuple[int, ...]]) -> Any:
    """The step's seeded draws (`Draw`): every trainable variable's noise sliced from
    one `jax.random.normal` of their total size under `key` (drawn at the first
    variable's request, once per trace), the adaptive count's (position
    `len(shapes)`) from `key` folded with its position.

    One draw, not one per variable: XLA compiles each `jax.random.normal` (threefry
    and the inverse error function) as a kernel of its own, about half a second on
    this CPU, and a compile comes with every new batch size (Poisson sampling):
    for the MLP of the zoo (6 variables) the noise's compile falls from 3.6 s to
    0.7 s, its run unchanged (`benchmarks/jax_batch_sizes.py`, docs/jax.md).
    """
    sizes = [math.prod(shape) for shape in shapes]
    offsets = [sum(sizes[:p]) for p in range(len(sizes))]
    drawn: list[Any] = []

    def draw(position: int, shape: tuple[int, ...], scale: Any) -> Any:
        if position == len(shapes):
            normal = jax.random.normal(jax.random.fold_in(key, position), shape, jnp.float32)
            return scale * normal
        if not drawn:
            drawn.append(jax.random.normal(key, (sum(sizes),), jnp.float32))
        start = offsets[position]
        part = jax.lax.slice(drawn[0], (start,), (start + sizes[position],))
        return scale * jnp.reshape(part, shape)

    return draw


def step_bound(model: keras.Model, settings: PrivacySettings) -> Any:
    """The step's one bound `C`: the settings' sensitivity (a float), or with adaptive
    clipping the bound variable's value in the step's `keras.StatelessScope`."""
    if settings.adaptive_clip is None:
        return settings.sensitivity
    return jnp.asarray(keras.ops.convert_to_tensor(model.__dict__[BOUND_KEY]), jnp.float32)


def penalty_gradients(
    model: keras.Model,
    trainable: Sequence[Any],
    added_losses: Sequence[int],
    weights: Sequence[Any] | None = None,
) -> list[Any] | None:
    """The gradient of the weight penalties (`variable.regularizer`), which do not
    depend on the data and are added unclipped and without noise; None without any.

    Args:
        model: The private model.
        trainable: The values of its trainable variables.
        added_losses: Per `stateless_call` of the step that returned its losses, how
            many (as the step's first trace saw them).
        weights: Per penalty (`penalties.regularized_variables`), the weight with
            which the loss holds it (`penalties.probing_penalties`); None: Keras'
            own step, which adds each once.

    Raises:
        ValueError: When the forward pass adds other losses (`add_loss`, activity
            regularizers): not a sum of per-example terms, nothing to clip.
    """
    regularized = shared.regularized_variables(model)
    expected = [len(regularized)] if weights is None else [len(regularized)] * len(added_losses)
    if list(added_losses) != expected:
        raise ValueError(
            shared.added_losses_refusal(model, list(added_losses), len(regularized), BACKEND)
        )
    if not regularized:
        return None
    if weights is None:
        weights = [1.0] * len(regularized)

    def total(values: Sequence[Any]) -> Any:
        return sum(
            weight * f32(variable.regularizer(values[p]))
            for (p, variable), weight in zip(regularized, weights)
        )

    return list(jax.grad(total)(list(trainable)))


def local_vjp(
    layer: Any, values: Any, fixed: Any, inputs: Any, kwargs: Any, cotangent: Any
) -> list[Any]:
    """`d <z(theta), cotangent> / d theta` at `values`: the layer's (pre-activation)
    output on the recorded `inputs`, pulled back to its trainable variables."""

    def output(values: Any) -> Any:
        return preactivation_call(layer, values, fixed, inputs, kwargs)

    outputs, vjp = jax.vjp(output, values)
    (grads,) = vjp(cotangent.astype(outputs.dtype))
    return list(grads)


def optimizer_value(model: keras.Model, optimizer_variables: Any, read: Any) -> Any:
    """`read(optimizer)` with the optimizer's variables at `optimizer_variables`."""
    optimizer = model.optimizer
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_variables))):
        return jnp.asarray(keras.ops.convert_to_tensor(read(optimizer)))


def step_key(model: keras.Model, seed: int, optimizer_variables: Any) -> Any:
    """The noise's key for this step: the base seed folded with the optimizer's step
    count (its `iterations` before the step: with accumulation, logical batches)."""
    iterations = optimizer_value(model, optimizer_variables, lambda o: o.iterations)
    return jax.random.fold_in(jax.random.key(seed), iterations.astype(jnp.uint32))


def logical_iterations(model: keras.Model, optimizer_variables: Any) -> int | None:
    """The optimizer's `iterations` (logical batches) at `optimizer_variables`, read
    to the host, for a model accumulating batches; None for another (one update a step)."""
    settings = settings_of(model)
    if settings is None or settings.accumulation_steps == 1:
        return None
    return int(optimizer_value(model, optimizer_variables, lambda o: o.iterations))
