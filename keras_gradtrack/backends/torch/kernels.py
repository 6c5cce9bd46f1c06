"""PyTorch kernels of the shared math where `keras.ops` dispatch or autograd is the cost.

On eager PyTorch every `keras.ops` call converts and checks its arguments (about ten
Python calls each); on a model of a few Dense layers the shared Dense rule's dozen
ops cost more in dispatch than in arithmetic, `torch.einsum` over a convolution's
strided windows runs slower than a batched product of the same values, and the
private step's local VJP of a Dense layer by autograd runs the layer's forward pass
again. The kernels here compute the same math in `torch` directly where that is
measured faster, and hand every other case to the shared form (`backends/ops/rules.py`,
`conv.py`, `private_step.local_vjp`). Each is tested against the shared form (and
torch's own gradients) on the shapes it takes (`tests/torch_backend/test_torch_kernels.py`).

Example:

```python
DENSE.primitives(layer, call, refs)   # 2-D inputs: torch ops; sequences: the shared rule
CONV.per_example(layer, values, call)  # one torch.bmm per kernel offset
dense_local_vjp(layer, values, inputs, cotangent)  # [x^T C, sum C], or None
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import torch

from keras_gradtrack import rule_math
from keras_gradtrack.backends.ops import conv as ops_conv
from keras_gradtrack.backends.ops import rules as ops_rules
from keras_gradtrack.backends.ops.rules import LayerPrimitives, ProbedCall


def dense_primitives(
    layer: Any, call: ProbedCall, refs: Sequence[Any] | None
) -> LayerPrimitives | None:
    """`ops_rules.dense_primitives` on 2-D inputs, in torch: `||g_i||^2 = (||a_i||^2 (+ 1
    with a bias)) ||d_i||^2`, `<g_i, R>` as `a_i^T R d_i` or, with a reference factor `c`
    where it takes fewer products, `c sum_j <a_i, a_j> <d_i, d_j>` (none with `refs=None`:
    norm-only). Other inputs: the shared rule, materialized here (eager: the backward
    pass computes the kernel's batch gradient whatever the step does)."""
    if call.inputs.dim() != 2 or not ops_rules.plain_weights(layer):
        return ops_rules.dense_primitives(layer, call, refs, materialize=True)
    if refs is not None and len(layer.trainable_variables) != len(refs):
        return None
    found = layer.trainable_variables if refs is None else refs
    by_name = {v.name: ref for v, ref in zip(layer.trainable_variables, found)}
    kernel_ref, bias_ref = by_name["kernel"], by_name.get("bias")
    a, d = call.inputs.float(), call.output_grad.float()
    batch, width_in = a.shape
    width_out = d.shape[1]
    a_sq, d_sq = torch.sum(a * a, dim=1), torch.sum(d * d, dim=1)
    factor = call.reference_factor
    if refs is None:
        dot = None
    elif factor is not None and rule_math.gram_has_fewer_products(batch, width_in, width_out):
        dot = factor * torch.sum((a @ a.T) * (d @ d.T), dim=1)
    else:
        dot = torch.sum((a @ kernel_ref.float()) * d, dim=1)
    sum_sq_norm = None if factor is not None else torch.sum((a.T @ d) ** 2)
    if bias_ref is None:
        return LayerPrimitives(a_sq * d_sq, dot, sum_sq_norm)
    if dot is not None:
        dot = dot + d @ bias_ref.float()
    if sum_sq_norm is not None:
        sum_sq_norm = sum_sq_norm + torch.sum(torch.sum(d, dim=0) ** 2)
    return LayerPrimitives((a_sq + 1.0) * d_sq, dot, sum_sq_norm)


def kernel_gradients(windows: Sequence[Any], output_grad: Any, groups: int = 1) -> Any:
    """`rule_math.kernel_gradients` of an ungrouped convolution in torch: per kernel
    offset k, `S_ik^T D_i` as one batched matrix product of the window made contiguous
    (`torch.einsum` on the strided windows runs about twice as long on a CPU: the zoo's
    CNN, tracked, 133 -> 122 ms a step at B=128 and 833 -> 726 ms at B=512, plain 67 and
    478 ms; one grouped convolution with the examples as groups measured the same as
    this). Grouped convolutions: the shared form."""
    if groups != 1:
        return rule_math.kernel_gradients(windows, output_grad, groups)
    d = output_grad.float()
    batch, filters = d.shape[0], d.shape[-1]
    d = d.reshape(batch, -1, filters)
    per_offset = []
    for window in windows:
        s = window.float().reshape(batch, -1, window.shape[-1])  # (B, P, C), one copy
        per_offset.append(torch.bmm(s.transpose(1, 2), d))
    return torch.stack(per_offset, dim=1)


def conv_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """`ops_conv.conv_per_example` with the kernel gradients of `kernel_gradients`."""
    return ops_conv.conv_per_example(layer, values, call, others, kernel_gradients)


def dense_local_vjp(layer: Any, values: Sequence[Any], inputs: Any, cotangent: Any) -> list | None:
    """The local VJP of a plain Dense layer's pre-activation output `z = x W + b` (what
    the private step's clipped sum pulls the reweighted output gradients back through):
    `x^T C` and `sum C` over every example and position, in one product, without the
    layer's forward pass again and autograd's (`private_step.local_vjp`). None for any
    other layer (a subclass with its own `call`, LoRA, quantized) or other than float32
    values, inputs and cotangent (mixed precision: autograd's, in the layer's dtypes)."""
    if not isinstance(layer, keras.layers.Dense) or type(layer).call is not keras.layers.Dense.call:
        return None
    if not ops_rules.plain_weights(layer):
        return None
    if any(t.dtype != torch.float32 for t in (inputs, cotangent, *values)):
        return None
    x = inputs.reshape(-1, inputs.shape[-1])
    c = cotangent.reshape(-1, cotangent.shape[-1])
    grads = {"kernel": x.T @ c, "bias": torch.sum(c, dim=0)}
    return [grads[v.name] for v in layer.trainable_variables]


DENSE = dataclasses.replace(ops_rules.DENSE, primitives=dense_primitives)
CONV = dataclasses.replace(ops_conv.CONV, per_example=conv_per_example)
# The rules whose math runs on these kernels on PyTorch, by the shared rules' names.
RULES = (DENSE, CONV)
