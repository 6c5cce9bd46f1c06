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

What a backend gives: the layer's local VJP (`LocalVjp`) and its exact per-layer
fallback (`PerExample`), the noise's draws (`Draw`: seeded, or `secure_noise.py`'s),
and the penalties' gradient (its autodiff). JAX's step (`backends/jax/private_step.py`)
runs these inside its `jax.jit`; PyTorch's (`backends/torch/private_step.py`) eagerly.

Example:

```python
weights, clipped = clip_weights(settings, model, plan, sq_norms, bound)
sums = clipped_sums(model, plan, probed, weights, factor, local_vjp, fallback)
gradients = noised_gradients(model, sums, probed.trainable, draw, noise, divisor, None)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.rules import PerExample, ProbedCall, summed_per_example
from keras_gradtrack.backends.ops.step import direct_primitives, probed_calls, value_lookup
from keras_gradtrack.engine import clip_weights as shared_clipping
from keras_gradtrack.engine.private_settings import PrivacySettings

# `(layer, values, fixed, inputs, kwargs, cotangent) -> grads`: `d <z(theta), cotangent>
# / d theta` of the layer's (pre-activation) output on the recorded inputs.
LocalVjp = Callable[[Any, Sequence[Any], Sequence[Any], Any, Any, Any], list[Any]]
# `(position, shape, scale) -> scale * N(0, I)` of `shape`, for trainable variable
# `position` (`len(trainable)`: the adaptive bound's count of unclipped examples).
Draw = Callable[[int, tuple[int, ...], Any], Any]


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
        references = [f32(probed.grads[position[id(v)]]) for v in all_variables]
        calls = per_layer_calls[index]
        total: list[Any] | None = None
        rule = tracked.rule
        if columns is not None:
            per_example = columns[index][0].per_example
            if rule is None or rule.per_example is None:
                per_example = None  # the fallback's: its local VJP costs less
        elif from_per_example(tracked, calls, references):
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


def step_divisor(settings: PrivacySettings, batch: int) -> float:
    """What the clipped sum goes over: `B_expected`, or the batch's size without one.
    Keras' gradient accumulation applies the mean of k physical batches' gradients,
    so with `accumulation_steps` k each goes over `B_expected / k` (only the k-th
    carries the logical batch's noise: the backend's step says when)."""
    divisor = settings.expected_batch_size or float(batch)
    if settings.accumulation_steps > 1 and settings.expected_batch_size is not None:
        divisor = divisor / settings.accumulation_steps
    return divisor


def noised_gradients(
    model: keras.Model,
    sums: dict[int, Any],
    trainable: Sequence[Any],
    draw: Draw | None,
    noise_scale: Any,
    divisor: Any,
    penalties: Sequence[Any] | None,
    loss_scale: Any = None,
) -> list[Any]:
    """What the optimizer receives, aligned with `model.trainable_variables`: each
    clipped sum plus `noise_scale * N(0, I)` (none where `draw` is None), over
    `divisor`, plus the penalties' gradient; times the loss scale (the optimizer
    unscales it), in each variable's dtype.

    Raises:
        ValueError: A trainable variable in no tracked layer (nothing clips it).
    """
    gradients = []
    for position, (variable, value) in enumerate(zip(model.trainable_variables, trainable)):
        if id(variable) not in sums:
            raise ValueError(
                "A private step needs every trainable variable to belong to a tracked "
                f"layer. Received: {variable.path!r}"
            )
        gradient = sums[id(variable)]
        if draw is not None:
            gradient = gradient + draw(position, tuple(value.shape), noise_scale)
        gradient = gradient / divisor
        if penalties is not None:
            gradient = gradient + f32(penalties[position])
        if loss_scale is not None:
            gradient = gradient * loss_scale
        gradients.append(ops.cast(gradient, value.dtype))
    return gradients


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
