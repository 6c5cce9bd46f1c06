"""The private step on PyTorch (DP-SGD): what it takes of the torch backend.

The step's math is the shared `backends/ops/private_step.py` (the clipped sums from
the one `torch.autograd.grad` of the tracked step, the noise once per variable, over
`B_expected`), with the clipping weights of `engine/clip_weights.py`, as on JAX and
TensorFlow. What is PyTorch's:

* each layer's local VJP (`local_vjp`): `torch.autograd.grad` of the layer's
  pre-activation output on the recorded inputs, at the step's values, with the
  reweighted output gradients `w_i d_i` (the layer's own operations only);
* the noise: `torch.randn` in float32 from a `torch.Generator` seeded with the base
  seed of `make_private` and the optimizer's step count (a run is reproducible),
  one draw per variable in the order of `trainable_variables`, the adaptive bound's
  count after them; with `secure_noise=True` the host draw of
  `backends/ops/secure_noise.py` (`os.urandom`, float64, as on TensorFlow and JAX);
* the weight penalties' gradient (`variable.regularizer`, added unclipped and
  without noise) by `torch.autograd.grad`; other added losses (`add_loss`) refused;
* adaptive clipping's bound, a Keras variable assigned after the step (eager).

Example:

```python
gradients, rows = private_gradients(model, plan, probed, columns, factor)
model.optimizer.apply(gradients, model.trainable_weights)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch
from keras import ops

from keras_gradtrack._keras_seam import optimizer_apply_count
from keras_gradtrack.backends.ops import private_step as shared
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.private_model import BOUND_KEY
from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.backends.ops.secure_noise import host_secure_normal
from keras_gradtrack.backends.torch.fallback import fallback_per_example
from keras_gradtrack.backends.torch.kernels import dense_local_vjp
from keras_gradtrack.engine.private_settings import settings_of
from keras_gradtrack.privacy.adaptive_clip import next_bound

BACKEND = "PyTorch"


def private_gradients(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    probed: Any,
    columns: Sequence[Any],
    factor: Any,
    loss_scale: float | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """`(gradients, rows)`: what the optimizer receives (aligned with
    `model.trainable_variables`) and the values for fit's logs
    (`dp_fraction_clipped`, with adaptive clipping `dp_l2_norm_clip`).

    Args:
        model: The private model, after the step's forward pass (its `losses`).
        plan: Its tracked layers.
        probed: The step's `ProbedPass`.
        columns: Per tracked layer, its primitives and `||G^(k)||^2`.
        factor: `c`, with which the loss reduces the examples' losses.
        loss_scale: The optimizer's `loss_scale_factor` `s`, or None: `probed` holds
            the unscaled gradients, and the optimizer receives `s` times the private
            gradient, which it unscales.

    Raises:
        ValueError: When the forward pass adds losses other than weight penalties, or
            a trainable variable is in no tracked layer.
    """
    settings = settings_of(model)
    assert settings is not None
    penalties = penalty_gradients(model, probed.trainable)
    adaptive = settings.adaptive_clip
    bound = settings.sensitivity if adaptive is None else float(model.__dict__[BOUND_KEY].numpy())
    weights, clipped = shared.clipping_weights(settings, model, plan, columns, bound)
    sums = shared.clipped_sums(
        model, plan, probed, weights, factor, local_vjp, fallback_per_example, None, columns
    )
    batch = int(clipped.shape[0])
    divisor = shared.step_divisor(settings, batch)
    sigma = settings.gradient_noise_multiplier
    noised = sigma > 0.0
    k = settings.accumulation_steps
    optimizer = model.optimizer
    if k > 1:  # only the k-th physical batch carries the logical batch's noise
        noised = noised and (int(optimizer_apply_count(optimizer)) + 1) % k == 0
    device = probed.trainable[0].device
    draw = NoiseDraws(settings.seed, int(optimizer.iterations), settings.secure_noise, device)
    gradients = shared.noised_gradients(
        model,
        sums,
        probed.trainable,
        draw if noised else None,
        sigma * bound,
        divisor,
        penalties,
        loss_scale,
    )
    clipped_count = float(ops.sum(ops.cast(clipped, "float32")))
    rows: dict[str, Any] = {"dp_fraction_clipped": clipped_count / batch}
    if adaptive is not None:
        rows["dp_l2_norm_clip"] = bound
        count_noise = 0.0
        if adaptive.clipped_count_stddev > 0:
            position = len(model.trainable_variables)
            count_noise = float(draw(position, (), adaptive.clipped_count_stddev))
        found = next_bound(
            bound, batch - clipped_count, float(batch), count_noise, divisor, adaptive
        )
        model.__dict__[BOUND_KEY].assign(found)
    return gradients, rows


class NoiseDraws:
    """The step's `scale * N(0, I)` draws (`shared.Draw`): seeded by the base seed and
    the optimizer's step count, one after another from one generator (or secure)."""

    def __init__(self, seed: int, iterations: int, secure: bool, device: Any) -> None:
        self.secure, self.device = secure, device
        # Both numbers mixed into every bit (torch's CPU generator reads the low 32).
        state = np.random.SeedSequence([seed, iterations]).generate_state(1, np.uint64)
        self.generator = torch.Generator().manual_seed(int(state[0]) % 2**63)

    def __call__(self, position: int, shape: tuple[int, ...], scale: Any) -> Any:
        if self.secure:
            noise = torch.from_numpy(host_secure_normal(shape, scale))
        else:
            noise = scale * torch.randn(shape, generator=self.generator, dtype=torch.float32)
        return noise.to(self.device)


def local_vjp(
    layer: Any, values: Any, fixed: Any, inputs: Any, kwargs: Any, cotangent: Any
) -> list[Any]:
    """`d <z(theta), cotangent> / d theta` at `values`: the layer's (pre-activation)
    output on the recorded `inputs`, pulled back to its trainable variables (a plain
    Dense layer's in one product, `kernels.dense_local_vjp`)."""
    fast = dense_local_vjp(layer, values, inputs, cotangent)
    if fast is not None:
        return fast
    with torch.enable_grad():
        leaves = [value.detach().requires_grad_(True) for value in values]
        outputs = preactivation_call(layer, leaves, [v.detach() for v in fixed], inputs, kwargs)
        grads = torch.autograd.grad(
            outputs, leaves, grad_outputs=cotangent.to(outputs.dtype), allow_unused=True
        )
    return [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, grads)]


def penalty_gradients(model: keras.Model, trainable: Sequence[Any]) -> list[Any] | None:
    """The gradient of the weight penalties (`variable.regularizer`), which do not
    depend on the data and are added unclipped and without noise; None without any.

    Raises:
        ValueError: When the forward pass added other losses (`add_loss`, activity
            regularizers): not a sum of per-example terms, nothing to clip.
    """
    regularized = shared.regularized_variables(model)
    seen = len(model.losses)
    if seen != len(regularized):
        raise ValueError(
            shared.added_losses_refusal(model, seen - len(regularized), len(regularized), BACKEND)
        )
    if not regularized:
        return None
    with torch.enable_grad():
        leaves = {p: trainable[p].detach().requires_grad_(True) for p, _ in regularized}
        total = sum(variable.regularizer(leaves[p]) for p, variable in regularized)
        grads = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
    return [grads.get(p, torch.zeros_like(value)) for p, value in enumerate(trainable)]
