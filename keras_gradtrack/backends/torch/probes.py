"""Probes on PyTorch: each tracked layer's (pre-activation) output, kept for the backward pass.

PyTorch differentiates with respect to any tensor of the graph, so the probe of a
layer's output is the output itself: `torch.autograd.grad(loss, [*weights,
*probes.probed])` gives, in the same one backward pass as the weights' gradients,
`c d l_i / d z_i` at every probed output (no example's output reaches another
example's loss). The probes are installed on the layer instances for the forward
pass, as the layer's `call` (and `activation`, to reach the output before it), and
record what each call received.

Example:

```python
probes = Probes(layers)
with probes.installed():
    y_pred = model(x, training=True)
grads = torch.autograd.grad(loss, probes.probed)
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from keras_gradtrack.backends.ops.probes import ProbeRecords


def probed_output(leaf: Any, first: Any) -> bool:
    """Whether a layer's output tensor can be probed: floating, with the batch's rows
    (those of the layer's first output)."""
    return (
        isinstance(leaf, torch.Tensor)
        and leaf.is_floating_point()
        and leaf.ndim >= 1
        and leaf.shape[0] == first.shape[0]
    )


class Probes(ProbeRecords):
    """Records, per call of `layers`, the inputs and the probed outputs."""

    BACKEND = "PyTorch"

    @contextlib.contextmanager
    def installed(
        self, batchless: frozenset[int] = frozenset(), batch_size: int = 0
    ) -> Iterator[Probes]:
        """The probing calls on their layers for the block (`ProbeRecords.patched_calls`)."""
        with self.patched_calls(batchless, batch_size):
            yield self

    def _probed_output(self, leaf: Any, first: Any) -> bool:
        return probed_output(leaf, first)

    def _probe(self, tensor: Any) -> Any:
        self.probed.append(tensor)
        return tensor
