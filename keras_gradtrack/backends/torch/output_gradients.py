"""Per-output-feature weight gradients on PyTorch (`OutputGradientLogger`): one
forward pass and `torch.autograd.grad` with one feature's cotangent at a time, the
graph kept between them.

Example:

```python
gradients = output_gradients(model, variables, axis=-1, chunk_size=4)
for features, grads in gradients(x):
    ...
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from keras import ops

from keras_gradtrack.backends.ops.output_gradients import OutputGradients, feature_cotangent


def output_gradients(
    model: Any, variables: Sequence[Any], axis: int, chunk_size: int
) -> OutputGradients:
    """`OutputGradients` of `model`'s output features with respect to `variables`."""
    leaves = [v.value for v in variables]

    def chunk(x: Any, features: np.ndarray) -> tuple[Sequence[Any], int]:
        with torch.enable_grad():
            y = model(x)
        feature_axis = axis % y.ndim
        grads: list[list[Any]] = [[] for _ in leaves]
        for feature in features:
            if feature >= y.shape[feature_axis]:
                found: Sequence[Any] = [None] * len(leaves)
            else:
                cotangent = feature_cotangent(y.shape, feature_axis, int(feature), ops)
                found = torch.autograd.grad(
                    y,
                    leaves,
                    grad_outputs=cotangent.to(y.dtype),
                    retain_graph=True,
                    allow_unused=True,
                )
            for kept, leaf, grad in zip(grads, leaves, found):
                kept.append(torch.zeros_like(leaf) if grad is None else grad.detach())
        return [torch.stack(kept) for kept in grads], int(y.shape[feature_axis])

    return OutputGradients(chunk, chunk_size)
