"""The probed engines' private step (DP-SGD), written once over `keras.ops`.

For a model made private (`make_private`), a probed engine's tracked step hands the
optimizer, in place of the batch gradient,

    (sum_i min(1, C / ||g_i||) g_i + N(0, sigma^2 C^2 I)) / B_expected

from its one backward pass with the probes, as the TensorFlow engine does
(`engine/clipping.py`):

* each example's norm `||g_i||` from every layer's squared norms (`sq_norm`, the
  primitives the statistics use: a rule's direct form, its per-example gradients,
  or the fallback); the weights `w_i = min(1, C / ||g_i||)` (per group of layers
  with bounds per group) from the shared `engine/clip_weights.py`;
* each layer's clipped sum (`clipped_sums`): where its norms came from its rule's
  per-example gradients (a convolution), their sum weighted by `w_i`; elsewhere the
  layer's local vector-Jacobian product from its (pre-activation) output to its own
  variables, at the inputs the step recorded, with output gradients `w_i d_i` (for a
  Dense layer, `A^T (w * D)`): only the layer's own operations lie between them, no
  second backward pass through the model, no loop over examples;
* the noise drawn once per variable and the sum over `B_expected` (`noised_gradients`),
  weight penalties added unclipped and without noise, other added losses refused
  (`added_losses_refusal`).

`private_gradients` runs these steps in order, and with adaptive clipping the bound's
update; what a backend gives is one `BackendStep`: the layer's local VJP (`LocalVjp`)
and its exact per-layer fallback (`PerExample`), the step's bound, the noise's draws
(`Draw`: seeded, or `secure_noise.py`'s) and whether this step carries the noise (with
accumulation, only a logical batch's last), and the penalties' gradient (its
autodiff). JAX's step (`backends/jax/private_step.py`) runs it inside its `jax.jit`;
PyTorch's (`backends/torch/private_step.py`) eagerly.

Example:

```python
step = BackendStep(bound, penalties, local_vjp, fallback, draw)
gradients, rows = private_gradients(step, model, plan, probed, columns, factor)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.private_model import BOUND_KEY
from keras_gradtrack.backends.ops.rules import PerExample, ProbedCall, summed_per_example
from keras_gradtrack.backends.ops.step import direct_primitives, probed_calls, value_lookup
from keras_gradtrack.engine import clip_weights as shared_clipping
from keras_gradtrack.engine.clip_weights import step_divisor
from keras_gradtrack.engine.private_gradient import Draw, noised_gradients
from keras_gradtrack.engine.private_settings import PrivacySettings, settings_of
from keras_gradtrack.privacy.adaptive_clip import next_bound

# `(layer, values, fixed, inputs, kwargs, cotangent) -> grads`: `d <z(theta), cotangent>
# / d theta` of the layer's (pre-activation) output on the recorded inputs.
LocalVjp = Callable[[Any, Sequence[Any], Sequence[Any], Any, Any, Any], list[Any]]


def f32(value: Any) -> Any:
    return ops.cast(value, "float32")


def clipped_sums(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    probed: Any,
    weights: Sequence[Any],
    factor: Any,
    local_vjp: LocalVjp,
    fallback: PerExample,
    loss_scale: Any = None,
    columns: Sequence[Any] | None = None,
) -> dict[int, Any]:
    """`{id(variable): sum_i w_i g_i}` (float32) of every tracked layer's own variables.

    A layer whose norms come from its rule's per-example gradients (a convolution
    without a cheaper Gram form, a layer with a rule called more than once) sums them
    with the weights, `sum_i w_i g_i` (under `jax.jit`, XLA merges that computation
    with the statistics' own). Another layer's clipped sum is `sum_calls d <z_c(theta),
    w * d_c> / d theta` at the recorded inputs of each call: its local VJP with the
    reweighted output gradients (linear in them, so the VJP takes the sum over
    examples). With a loss scale `s` the VJP takes `s w_i d_i` (the backward pass's
    scale, in the layer's dtype) and its result is divided by `s` in float32. With the
    step's `columns`, a layer's per-example gradients are those its norms came from
    (an eager backend computes nothing twice); without, they are computed again where
    the layer has no direct form (under `jax.jit` the compiler merges the two).

    Raises:
        ValueError: A tracked layer the step did not call.
    """
    value_of = value_lookup(model, probed)
    per_layer_calls = probed_calls(probed, factor, len(plan))
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    sums: dict[int, Any] = {}
    for index, (tracked, weight) in enumerate(zip(plan, weights)):
        layer = tracked.layer
        all_variables = list(layer.trainable_variables)
        values = [value_of(v) for v in all_variables]
        fixed = [value_of(v) for v in layer.non_trainable_variables]
        calls = per_layer_calls[index]
        total: list[Any] | None = None
        rule = tracked.rule
        if columns is not None:
            per_example = columns[index][0].per_example
            if rule is None or rule.per_example is None:
                per_example = None  # the fallback's: its local VJP costs less
        elif from_per_example(
            tracked, calls, [f32(probed.grads[position[id(v)]]) for v in all_variables]
        ):
            per_example = summed_per_example(layer, rule, values, calls, fixed, fallback)
        else:
            per_example = None
        if per_example is not None:
            total = [ops.tensordot(weight, f32(g), axes=1) for g in per_example]
        else:
            for n, (owner, kwargs) in enumerate(probed.calls):
                if owner != index:
                    continue
                inputs, grad = probed.inputs[n], f32(probed.probe_grads[n]) / factor
                reweighted = grad * ops.reshape(weight, (-1,) + (1,) * (len(grad.shape) - 1))
                if loss_scale is not None:
                    reweighted = reweighted * loss_scale
                grads = local_vjp(layer, values, fixed, inputs, kwargs, reweighted)
                if loss_scale is not None:
                    grads = [f32(g) / loss_scale for g in grads]
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
        if total is None:
            raise ValueError(
                f"Tracked layer {tracked.name!r} was not called in the step, so its "
                "clipped gradient is not defined."
            )
        own = {id(v) for v in tracked.variables}
        for variable, grad in zip(all_variables, total):
            if id(variable) in own:
                sums[id(variable)] = f32(grad)
    return sums


def from_per_example(
    tracked: TrackedLayer, calls: Sequence[ProbedCall], references: Sequence[Any]
) -> bool:
    """Whether the layer's norms come from its rule's per-example gradients (no direct
    form for this step), so that its clipped sum is their weighted sum."""
    rule = tracked.rule
    if not calls or rule is None or rule.per_example is None:
        return False
    return direct_primitives(tracked, calls, references) is None


def clipping_weights(
    settings: PrivacySettings,
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    columns: Sequence[Any],
    bound: Any,
) -> tuple[Any, Any]:
    """`(weights, clipped)`: each example's `w_i = min(1, C / ||g_i||)` at the bound
    `C` from the columns' squared norms (`clip_weights.clip_weights`, looked up through
    its module: the seam of the audit's control, `privacy_audit.clipping_off`), and
    whether it was clipped."""
    sq_norms = [ops.maximum(f32(primitives.sq_norm), 0.0) for primitives, _ in columns]
    return shared_clipping.clip_weights(settings, model, plan, sq_norms, bound)


@dataclasses.dataclass(frozen=True)
class BackendStep:
    """What a backend's private step hands `private_gradients` for one step.

    Attributes:
        bound: The step's `C` (adaptive clipping: the bound before its update).
        penalties: The weight penalties' gradient per trainable variable, or None.
        local_vjp: The backend's local VJP of a layer (`LocalVjp`).
        fallback: The backend's exact per-layer fallback (`PerExample`).
        draw: The step's seeded (or secure) draws (`Draw`).
        noised: Whether this step carries the noise (with accumulation, only a
            logical batch's last): a bool, or a traced boolean.
        eager: An eager backend: the clipped sums reuse the columns' per-example
            gradients (nothing computed twice) and the rows are host floats.
    """

    bound: Any
    penalties: Sequence[Any] | None
    local_vjp: LocalVjp
    fallback: PerExample
    draw: Draw
    noised: Any = True
    eager: bool = False


def private_gradients(
    step: BackendStep,
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    probed: Any,
    columns: Sequence[Any],
    factor: Any,
    loss_scale: Any = None,
) -> tuple[list[Any], dict[str, Any]]:
    """`(gradients, rows)`: what the optimizer receives (aligned with
    `model.trainable_variables`) and the values for fit's logs (`dp_fraction_clipped`,
    with adaptive clipping `dp_l2_norm_clip`, whose variable it assigns `C_{t+1}`).

    Args:
        step: What the backend gives for this step (`BackendStep`).
        model: The private model, after the step's forward pass.
        plan: Its tracked layers.
        probed: The step's `ProbedPass`.
        columns: Per tracked layer, its primitives and `||G^(k)||^2`.
        factor: `c`, with which the loss reduces the examples' losses.
        loss_scale: `s`, the loss scale of the step's gradients, or None: the
            optimizer receives `s` times the private gradient, which it unscales.

    Raises:
        ValueError: When a trainable variable is in no tracked layer.
    """
    settings = settings_of(model)
    assert settings is not None
    bound = step.bound
    weights, clipped = clipping_weights(settings, model, plan, columns, bound)
    sums = clipped_sums(
        model,
        plan,
        probed,
        weights,
        factor,
        step.local_vjp,
        step.fallback,
        loss_scale,
        columns if step.eager else None,
    )
    batch = int(clipped.shape[0])
    divisor = step_divisor(settings, batch)
    sigma = settings.gradient_noise_multiplier
    noise_scale = sigma * bound
    if not isinstance(step.noised, bool):
        noise_scale = ops.where(step.noised, noise_scale, 0.0)
    draw = step.draw if sigma > 0.0 and step.noised is not False else None
    scale = 1.0 if loss_scale is None else loss_scale
    penalties = step.penalties
    if penalties is not None and loss_scale is not None:
        penalties = [f32(p) * loss_scale for p in penalties]
    gradients = noised_gradients(
        model.trainable_variables,
        sums,
        draw,
        noise_factor=noise_scale * (scale / divisor),
        sums_factor=scale / divisor,
        penalties=penalties,
    )
    clipped_count = ops.sum(ops.cast(clipped, "float32"))
    if step.eager:
        clipped_count = float(clipped_count)
    rows: dict[str, Any] = {"dp_fraction_clipped": clipped_count / batch}
    adaptive = settings.adaptive_clip
    if adaptive is not None:
        rows["dp_l2_norm_clip"] = bound
        count_noise: Any = 0.0
        if adaptive.clipped_count_stddev > 0:
            # The count's draw comes after every variable's.
            position = len(model.trainable_variables)
            count_noise = step.draw(position, (), adaptive.clipped_count_stddev)
            if step.eager:
                count_noise = float(count_noise)
        unclipped = batch - clipped_count
        found = next_bound(bound, unclipped, float(batch), count_noise, divisor, adaptive)
        model.__dict__[BOUND_KEY].assign(found)
    return gradients, rows


def regularized_variables(model: keras.Model) -> list[tuple[int, Any]]:
    """`(position, variable)` of each trainable variable with a penalty (`regularizer`)."""
    return [
        (position, variable)
        for position, variable in enumerate(model.trainable_variables)
        if getattr(variable, "regularizer", None) is not None
    ]


def added_losses_refusal(model: keras.Model, seen: Any, penalties: int, backend: str) -> str:
    """Why a private step refuses the losses its forward pass added besides the
    weight penalties (`add_loss`, activity regularizers)."""
    return (
        f"Model {model.name!r} adds losses with `add_loss` (or an activity "
        "regularizer): such a term is not a sum of per-example terms, so it has no "
        "per-example gradient to clip and private training would not bound each "
        "example's influence. Move the term into the compiled loss as a "
        f"per-example value, or remove it. (The {backend} backend's step saw "
        f"{seen} added losses and {penalties} weight penalties.)"
    )
