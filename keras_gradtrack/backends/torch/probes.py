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
from keras import tree

from keras_gradtrack.backends.ops.probes import ProbeRecords
from keras_gradtrack.backends.ops.recurrent import (
    from_output_rows,
    on_the_rule,
    output_rows,
    recurrent_call,
)
from keras_gradtrack.backends.ops.rules import splits_activation
from keras_gradtrack.engine.preactivation import marked_preactivation_call


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
            if on_the_rule(layer):  # the probe is the gate pre-activations `P`
                outputs, saved = recurrent_call(layer, original, args, kwargs, self._probe)
                self.calls[-1] = (index, saved, dict(kwargs))
                return outputs
            if splits_activation(layer):
                outputs, _ = marked_preactivation_call(
                    layer, original, args, kwargs, self._probe, "probed."
                )
                return outputs
            outputs = original(*args, **kwargs)
            leaves = tree.flatten(outputs)
            if not leaves or not all(probed_output(leaf, leaves[0]) for leaf in leaves):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) returned "
                    f"{type(outputs).__name__}: the PyTorch engine probes layers whose "
                    "output is one float tensor, or several with a row per example."
                )
            if isinstance(outputs, torch.Tensor):
                return self._probe(outputs)
            # Several outputs (a recurrent layer's sequence and states): one probe, their
            # rows side by side, from which the layer's outputs are read again (so that
            # the loss reaches them through it), as the fallback contracts them.
            return from_output_rows(self._probe(output_rows(outputs)), outputs)

        return probing_call
