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
from keras_gradtrack.backends.ops.rules import splits_activation
from keras_gradtrack.engine.preactivation import marked_preactivation_call


class Probes(ProbeRecords):
    """Records, per call of `layers`, the inputs and the probed outputs."""

    @contextlib.contextmanager
    def installed(
        self, batchless: frozenset[int] = frozenset(), batch_size: int = 0
    ) -> Iterator[Probes]:
        """The probing calls on their layers for the block (`ProbeRecords.patched_calls`)."""
        with self.patched_calls(batchless, batch_size):
            yield self

    def _probe(self, tensor: Any) -> Any:
        self.probed.append(tensor)
        return tensor

    def _probing_call(self, index: int, layer: Any) -> Any:
        original = layer.call

        def probing_call(*args: Any, **kwargs: Any) -> Any:
            args = self._recorded(index, layer, args, kwargs)
            if splits_activation(layer):
                outputs, _ = marked_preactivation_call(
                    layer, original, args, kwargs, self._probe, "probed."
                )
                return outputs
            outputs = original(*args, **kwargs)
            if not (
                isinstance(outputs, torch.Tensor)
                and outputs.is_floating_point()
                and outputs.ndim >= 1
            ):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) returned "
                    f"{type(outputs).__name__}: the PyTorch engine probes layers whose "
                    "output is one float tensor with a row per example."
                )
            return self._probe(outputs)

        return probing_call
