"""The private phase of a tracked step (DP-SGD): clipped per-example gradients, summed, plus noise.

For a model made private (`GradientTrackingMixin.make_private`), `tracked_gradient`
returns, in place of the batch gradient,

    s (sum_i min(1, C / ||g_i||) g_i + N(0, sigma^2 C^2 I)) / B_expected   (+ penalties)

(`s` the loss scale, which the optimizer divides out). It comes from the one
backward pass the step already ran, as Book-Keeping does:

* each example's norm `||g_i||` from every layer's squared norms (`sq_norm`, the
  same primitives the statistics use: rules, materialized gradients or fallback);
* the weights `w_i = min(1, C / ||g_i||)`, in float32;
* each layer's clipped sum, by its form:
  - materialized (the rule built `(B, ...)` per-example gradients): `sum_i w_i g_i`;
  - a rule with a tap of its own (a recurrent loop, a separable convolution), or a
    layer with a rule called more than once: the rule's per-example gradients of
    the reweighted output gradients `w_i d_i`, summed (every rule is linear in the
    output gradients);
  - a layer without a rule called more than once: the layer run again on its
    recorded inputs, under a tape of its own, for the same product;
  - otherwise (one call: a rule's direct form, a chunked layer, the fallback): the
    local vector-Jacobian product from the layer's tapped tensors to its own
    variables with output gradients `w_i d_i` (`tf.gradients` on the step's graph:
    only the layer's own operations lie between them). The backward pass's weight gradients
    of these layers are then unused, and TensorFlow prunes them from the step.

With bounds per group of layers (`C_k` per group; per tracked layer: groups of one),
`w_ik = min(1, C_k / ||g_i^(k)||)` for every layer of group k, `g_i^(k)` example i's
gradient restricted to the group, and the sensitivity is `sqrt(sum_k C_k^2)`.
Weight-regularization penalties do not depend on the data: their gradient is added
unclipped and without noise. Under a
`tf.distribute` strategy each replica clips its examples and the optimizer sums
the replicas' gradients; the noise is drawn on replica 0 only, so it enters the
global sum once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack._keras_seam import flatten_layers, layer_losses, optimizer_apply_count
from keras_gradtrack.engine import clip_weights as shared_clipping
from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.backward import Materialized
from keras_gradtrack.engine.fallback import per_example_output_products
from keras_gradtrack.engine.per_layer import layers_primitives
from keras_gradtrack.engine.plan import Plan, TrackedLayer
from keras_gradtrack.engine.private_gradient import noised_gradients
from keras_gradtrack.engine.private_settings import (
    PrivacySettings,
    batch_normalization_refusal,
    settings_of,
)
from keras_gradtrack.engine.private_settings import (  # preflight's refusal text
    steps_per_execution_refusal as steps_per_execution_refusal,
)
from keras_gradtrack.engine.secure_noise import secure_standard_normal
from keras_gradtrack.engine.step_state import StepState
from keras_gradtrack.engine.tracking import TrackingContext
from keras_gradtrack.engine.tracking_check import COUPLED, MATERIALIZED
from keras_gradtrack.privacy.adaptive_clip import next_bound


@dataclasses.dataclass(frozen=True)
class PrivateStep:
    """The private gradients (aligned with the sources), the values for fit's logs, and
    the step's (global) batch size."""

    gradients: list[Any]
    rows: dict[str, tf.Tensor]
    batch_size: tf.Tensor


def private_step(state: StepState) -> PrivateStep | None:
    """The step's private gradients, or None when the model is not private."""
    settings = settings_of(state.context.model)
    if settings is None:
        return None
    plan, forms = state.layers.plan, state.layers.forms
    refuse_unprivate(state.context, plan, forms)
    unscale = 1.0 / state.backward.factor
    # Per layer, `(B,)` ||g_i^(k)||^2 in the true scale (norms only: no reference).
    sq_norms = [
        tf.maximum(sq_norm, 0.0) * tf.square(unscale)
        for sq_norm, _ in layers_primitives(state, None)
    ]
    model = state.context.model
    bound = step_bound(model, settings)  # this step's C (adaptive: read before its update)
    weights, clipped = clip_weights(settings, model, plan, sq_norms, bound)

    # Each layer's clipped sum, in the rules' scale (`c s sum_i w_i g_i`).
    sums: dict[int, tf.Tensor] = {}
    for tracked, calls, form, weight in zip(plan, state.backward.calls, forms, weights):
        sums.update(clipped_sum(tracked, calls, form, weight, state.materialized))

    local_batch = tf.cast(tf.shape(clipped)[0], tf.float32)
    (global_batch,) = distribute.all_reduce_sum([local_batch])
    divisor = shared_clipping.step_divisor(settings, global_batch)

    def gradients_of(settings: PrivacySettings) -> list[Any]:
        return noisy_gradients(state, settings, sums, unscale, divisor, bound)

    if settings.accumulation_steps > 1:
        gradients = accumulated_gradients(model, settings, gradients_of)
    else:
        gradients = gradients_of(settings)
    # For fit's logs (a gradient logger also logs the norms: `privacy_statistics`).
    (clipped_count,) = distribute.all_reduce_sum([tf.reduce_sum(tf.cast(clipped, tf.float32))])
    rows = {"dp_fraction_clipped": clipped_count / global_batch}
    if settings.adaptive_clip is not None:
        rows["dp_l2_norm_clip"] = bound
        with tf.control_dependencies(gradients):  # the noise's scale read C_t
            unclipped = global_batch - clipped_count
            update_bound(state, settings, unclipped, global_batch, divisor, bound)
    return PrivateStep(gradients, rows, global_batch)


def step_bound(model: Any, settings: PrivacySettings) -> tf.Tensor | float:
    """The step's one bound `C` (a float: `settings.sensitivity`), or with adaptive
    clipping the current value of the model's bound variable."""
    if settings.adaptive_clip is None:
        return settings.sensitivity
    if distribute.num_replicas() > 1:
        raise ValueError(
            "Adaptive clipping runs on one replica: its bound is one variable updated "
            f"by each step. Received: {distribute.num_replicas()} replicas"
        )
    return tf.identity(model.__dict__["_adaptive_clip_bound"])


def update_bound(
    state: StepState,
    settings: PrivacySettings,
    unclipped_count: tf.Tensor,
    batch_size: tf.Tensor,
    divisor: tf.Tensor,
    bound: tf.Tensor,
) -> None:
    """Sets the model's bound to `C_{t+1}` (`adaptive_clip.next_bound`), the count of
    unclipped examples noised with deviation `clipped_count_stddev`."""
    clip = settings.adaptive_clip
    assert clip is not None
    count_noise = tf.constant(0.0)
    if clip.clipped_count_stddev > 0:
        position = len(state.request.sources)  # past the variables' draws
        if settings.secure_noise:
            count_noise = secure_standard_normal((), clip.clipped_count_stddev)
        else:
            seed = tf.random.experimental.stateless_fold_in(
                step_seed(state.context.model, settings.seed), position
            )
            count_noise = standard_normal((), seed, clip.clipped_count_stddev)
    variable = state.context.model.__dict__["_adaptive_clip_bound"]
    variable.assign(next_bound(bound, unclipped_count, batch_size, count_noise, divisor, clip))


def accumulated_gradients(
    model: Any,
    settings: PrivacySettings,
    gradients_of: Callable[[PrivacySettings], list[Any]],
) -> list[Any]:
    """One physical batch's part of a logical batch of `k`: what the optimizer receives,
    `gradients_of(settings)` (`noisy_gradients` of the step).

    Keras' `gradient_accumulation_steps` adds the `k` gradients it receives and
    applies their mean on the k-th; so each physical batch's clipped sum goes over
    `B_logical / k` (`clip_weights.step_divisor`: `expected_batch_size / k`, or the
    physical batch), and the noise is drawn on the k-th alone: one draw per logical
    batch, over the logical batch's expected size."""
    k = settings.accumulation_steps
    applies = optimizer_apply_count(model.optimizer)
    last = tf.equal((applies + 1) % k, 0)
    clean = dataclasses.replace(settings, noise_multiplier=0.0)
    return tf.cond(last, lambda: gradients_of(settings), lambda: gradients_of(clean))


def clip_weights(
    settings: PrivacySettings,
    model: Any,
    plan: Plan,
    sq_norms: Sequence[tf.Tensor],
    bound: tf.Tensor | float | None = None,
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """Per layer, each example's `(B,)` clipping weight `w_i`, and which examples were
    clipped (`(B,)` booleans), from the layers' squared norms (true scale): the shared
    `clip_weights.clip_weights` at this step's bound (`bound`, None: `step_bound`'s).
    The fraction clipped that fit's logs and a gradient logger report both come from it.
    Looked up through its module when the step is traced: the seam that the audit's
    control (`privacy_audit.clipping_off`) replaces, as on JAX."""
    if bound is None and not settings.per_layer:
        bound = step_bound(model, settings)
    return shared_clipping.clip_weights(settings, model, plan, sq_norms, bound)


def noisy_gradients(
    state: StepState,
    settings: PrivacySettings,
    sums: dict[int, tf.Tensor],
    unscale: tf.Tensor,
    divisor: tf.Tensor,
    bound: tf.Tensor | float | None = None,
) -> list[Any]:
    """Per source, what the optimizer receives: its clipped sum (`sums`, rules' scale)
    plus noise of deviation `sigma C`, over `divisor`, in the tape's scale, plus its
    penalties' part.

    The noise is `standard_normal`'s seeded float32 draw, or with `secure_noise`
    `secure_noise.secure_standard_normal`'s (float64 from the operating system's
    CSPRNG, scaled in float64 and cast once). `bound`: this step's `C` (None: the
    settings' sensitivity); with adaptive clipping `sigma` is the gradient's share
    (`settings.gradient_noise_multiplier`)."""
    context = state.context
    scale = context.loss_scale if context.loss_scale is not None else tf.constant(1.0)
    seed = step_seed(context.model, settings.seed)
    sigma = settings.gradient_noise_multiplier
    std = sigma * (settings.sensitivity if bound is None else bound)
    if settings.secure_noise and sigma > 0.0 and context.xla:
        raise ValueError(
            f"Model {context.model.name!r} has secure_noise=True, whose random bits are "
            "read on the host (`os.urandom`), which XLA cannot compile: compile with "
            "`jit_compile=False`."
        )

    def draw(position: int, shape: tuple[int, ...], factor: Any) -> tf.Tensor:
        if settings.secure_noise:
            return secure_standard_normal(shape, factor)
        return standard_normal(
            shape, tf.random.experimental.stateless_fold_in(seed, position), factor
        )

    sources = state.request.sources
    return noised_gradients(
        sources,
        sums,
        draw if sigma > 0.0 else None,
        noise_factor=(std * noise_switch()) * (scale / divisor),
        sums_factor=unscale * (scale / divisor),  # the sums are in the rules' scale
        penalties=[state.penalties.get(id(v)) for v in sources],
    )


def standard_normal(shape: Any, seed: tf.Tensor, scale: Any = 1.0) -> tf.Tensor:
    """`scale` times `N(0, 1)` draws of `shape` (float32), a stateless function of `seed`.

    The Box-Muller transform that `tf.random.stateless_normal`'s kernel applies, on
    the same float32 uniforms (23 random bits), written as whole-tensor operations:
    TensorFlow's kernel computes the logarithm, root, sine and cosine one pair of
    numbers at a time, where these operations are vectorized, 2-3x faster on CPU.
    `scale` multiplies the radii (half the draws' count) rather than the draws.
    """
    count = math.prod(shape)
    half = (count + 1) // 2
    uniform = tf.random.stateless_uniform([2, half], seed)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-uniform[0])) * scale  # 1 - u in (0, 1]: finite
    angle = (2.0 * math.pi) * uniform[1]
    normal = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)
    if count < 2 * half:  # an odd count: the last pair's sine is not used
        normal = normal[:count]
    return tf.reshape(normal, shape)


def clipped_sum(
    tracked: TrackedLayer,
    calls: Sequence[Any],
    form: str,
    weight: tf.Tensor,
    materialized: Materialized,
) -> dict[int, tf.Tensor]:
    """`{id(variable): sum_i w_i g_i}` of one layer (rules' scale), by its form."""
    variables = tracked.variables
    if form == MATERIALIZED and all(id(v) in materialized.per_example for v in variables):
        return {
            id(v): tf.reshape(
                tf.linalg.matvec(materialized.per_example[id(v)], weight, transpose_a=True),
                v.shape,
            )
            for v in variables
        }
    reweighted = [
        dataclasses.replace(
            call, output_grads=tuple(reweight(grad, weight) for grad in call.output_grads)
        )
        for call in calls
    ]
    rule = tracked.rule
    several = len(calls) > 1
    if rule is not None and (rule.tap is not None or (several and rule.per_example)):
        # A tap of the rule's own may record tensors of which one feeds another (the
        # steps of a loop), and a call's input may depend on the layer's own weights
        # through an earlier call (a layer called twice in a row): the rule's
        # per-example gradients, linear in the output gradients, give the sum exactly.
        if rule.per_example is None:
            raise ValueError(
                f"Layer {tracked.layer.name!r} has rule {rule.name!r}, whose tap is its own "
                "and which builds no per-example gradients, so its clipped sum is not "
                "defined for private training."
            )
        return {
            id(v): tf.reshape(tf.reduce_sum(tf.cast(g, tf.float32), axis=0), v.shape)
            for v, g in rule.per_example(tracked.layer, reweighted)
        }
    if rule is None and several:
        return rerun_product(tracked, reweighted)
    # One call (or calls on integer inputs): the local vector-Jacobian product on the
    # step's graph; only the layer's own operations lie between its tapped tensors and
    # its variables.
    tapped = [t for call in calls for t in call.tapped]
    grad_ys = [
        tf.cast(g, t.dtype) for call in reweighted for t, g in zip(call.tapped, call.output_grads)
    ]
    gradients = tf.gradients(
        tapped,
        list(variables),
        grad_ys=grad_ys,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    return {
        id(v): tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), v.shape)
        for v, g in zip(variables, gradients)
    }


def rerun_product(tracked: TrackedLayer, calls: Sequence[Any]) -> dict[int, tf.Tensor]:
    """`sum_c <y_c, w d_c>`'s gradient at the layer's variables, the layer run again on
    each call's recorded inputs under a tape of its own (which holds the inputs fixed):
    for a layer without a rule called more than once."""
    with tf.GradientTape() as tape:
        total = per_example_output_products(tracked.layer, calls)
        total = tf.reduce_sum(total)
    gradients = tape.gradient(
        total, list(tracked.variables), unconnected_gradients=tf.UnconnectedGradients.ZERO
    )
    return {
        id(v): tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), v.shape)
        for v, g in zip(tracked.variables, gradients)
    }


def reweight(gradient: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`w_i d_i`: each example's output gradient times its clipping weight."""
    rank = gradient.shape.rank
    return gradient * tf.reshape(weight, [-1] + [1] * (rank - 1))


def noise_switch() -> tf.Tensor:
    """1 on the replica that adds the noise (the first), 0 on the others."""
    if distribute.num_replicas() == 1:
        return tf.constant(1.0)
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.cast(tf.equal(replica, 0), tf.float32)


def step_seed(model: Any, base: int) -> tf.Tensor:
    """The noise's seed for this step: the base seed and the optimizer's step count."""
    iterations = tf.cast(model.optimizer.iterations, tf.int64)
    return tf.random.experimental.stateless_fold_in(tf.constant([base, 0], tf.int64), iterations)


def refuse_unprivate(context: TrackingContext, plan: Plan, forms: Sequence[str]) -> None:
    """Raises (while the step is traced, before any weight changes) on what cannot be private."""
    model = context.model
    if tf.executing_eagerly():
        raise ValueError(
            f"Private training of model {model.name!r} needs a compiled train step; it "
            "runs eagerly. Compile with `run_eagerly=False` (the default)."
        )
    if COUPLED in forms or getattr(model, "track_batch_normalization", False):
        raise ValueError(batch_normalization_refusal(model))
    added = [layer.name for layer in flatten_layers(model) if layer_losses(layer)]
    if added:
        raise ValueError(
            f"Layers {added} of model {model.name!r} add losses with `add_loss` (or an "
            "activity regularizer): such a term is not a sum of per-example terms, so it "
            "has no per-example gradient to clip and private training would not bound "
            "each example's influence. Move the term into the compiled loss as a "
            "per-example value, or remove it."
        )
