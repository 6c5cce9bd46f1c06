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
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from keras_gradtrack._patching import patched
from keras_gradtrack.backends.ops.batchless import broadcast_to_batch
from keras_gradtrack.backends.ops.rules import splits_activation
from keras_gradtrack.engine.preactivation import marked_preactivation_call


class Probes:
    """Installs probes on `layers` and records, per call, the inputs and probed tensors.

    Args:
        layers: The tracked layers.
    """

    def __init__(self, layers: Sequence[Any]):
        self.layers = list(layers)
        self.calls: list[tuple[int, Any, dict[str, Any]]] = []
        self.probed: list[Any] = []
        self._batchless: frozenset[int] = frozenset()
        self._batch_size = 0

    @contextlib.contextmanager
    def installed(
        self, batchless: frozenset[int] = frozenset(), batch_size: int = 0
    ) -> Iterator[Probes]:
        """The probes on their layers for the block. The calls at the positions in
        `batchless` (in call order) are made on their input broadcast to `batch_size`
        examples (`batchless.py`)."""
        self.calls, self.probed = [], []
        self._batchless, self._batch_size = batchless, batch_size
        with contextlib.ExitStack() as stack:
            for index, layer in enumerate(self.layers):
                stack.enter_context(patched(layer, "call", self._probing_call(index, layer)))
            yield self

    def _probe(self, tensor: Any) -> Any:
        self.probed.append(tensor)
        return tensor

    def _probing_call(self, index: int, layer: Any) -> Any:
        original = layer.call

        def probing_call(*args: Any, **kwargs: Any) -> Any:
            if not args:
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) was called without a "
                    "positional input: the PyTorch engine tracks a layer's first argument."
                )
            if len(self.calls) in self._batchless:
                args = (broadcast_to_batch(args[0], self._batch_size), *args[1:])
            self.calls.append((index, args[0], dict(kwargs)))
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
