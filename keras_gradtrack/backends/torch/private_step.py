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
  `privacy/secure_noise.py` (`os.urandom`, float64, as on TensorFlow and JAX);
* the weight penalties' gradient (`variable.regularizer`, added unclipped and
  without noise) by `torch.autograd.grad`; other added losses (`add_loss`) refused;
* adaptive clipping's bound, a Keras variable assigned after the step (eager).

Example:

```python
step = backend_step(model, probed)
gradients, rows = shared.private_gradients(step, model, plan, probed, columns, factor)
model.optimizer.apply(gradients, model.trainable_weights)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch

from keras_gradtrack._keras_seam import optimizer_apply_count
from keras_gradtrack.backends.ops import private_step as shared
from keras_gradtrack.backends.ops.private_model import BOUND_KEY
from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.backends.torch.fallback import fallback_per_example
from keras_gradtrack.backends.torch.kernels import dense_local_vjp
from keras_gradtrack.engine.private_settings import settings_of
from keras_gradtrack.privacy.secure_noise import host_secure_normal

BACKEND = "PyTorch"


def backend_step(model: keras.Model, probed: Any) -> shared.BackendStep:
    """What PyTorch gives the shared private step (`private_gradients`) for this step:
    the bound, the penalties' gradient, the local VJP and fallback, the step's seeded
    draws and whether it carries the noise.

    Args:
        model: The private model, after the step's forward pass (its `losses`).
        probed: The step's `ProbedPass`.

    Raises:
        ValueError: When the forward pass adds losses other than weight penalties.
    """
    settings = settings_of(model)
    assert settings is not None
    optimizer = model.optimizer
    bound = settings.sensitivity
    if settings.adaptive_clip is not None:
        bound = float(model.__dict__[BOUND_KEY].numpy())
    noised = True
    k = settings.accumulation_steps
    if k > 1:  # only the k-th physical batch carries the logical batch's noise
        noised = (int(optimizer_apply_count(optimizer)) + 1) % k == 0
    device = probed.trainable[0].device
    draw = NoiseDraws(settings.seed, int(optimizer.iterations), settings.secure_noise, device)
    penalties = penalty_gradients(model, probed.trainable)
    return shared.BackendStep(bound, penalties, local_vjp, fallback_per_example, draw, noised, True)


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
