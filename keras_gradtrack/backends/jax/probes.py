"""Probes: zeros added to each tracked layer's (pre-activation) output in the forward pass.

The tracked step differentiates the loss with respect to the trainable variables
and to these probes in one `jax.value_and_grad`: a probe's gradient is the
gradient of the loss at that output, per example (no example's output reaches
another example's loss). The probes are installed on the layer instances while
the step is traced, as the layer's `call` (and `activation`, to reach the output
before it), and record what each call received.

Example:

```python
probes = Probes(layers)
with probes.installed(None):          # a first trace records the probed shapes
    model(x)
shapes = [z.shape for z in probes.probed]
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

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
    """Whether a layer's output tensor can carry a probe: floating, with the batch's
    rows (those of the layer's first output)."""
    return (
        hasattr(leaf, "shape")
        and jnp.issubdtype(leaf.dtype, jnp.floating)
        and leaf.ndim >= 1
        and leaf.shape[0] == first.shape[0]
    )


def tensor_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a call that hold tensors, and only tensors."""
    found = {}
    for name, value in kwargs.items():
        leaves = jax.tree.leaves(value)
        if leaves and all(isinstance(leaf, jax.Array) for leaf in leaves):
            found[name] = value
    return found


class Probes(ProbeRecords):
    """Installs probes on `layers` and records, per call, the inputs and probed tensors.

    Args:
        layers: The tracked layers.
    """

    def __init__(self, layers: Sequence[Any]):
        super().__init__(layers)
        self._probes: Sequence[Any] | None = None

    @contextlib.contextmanager
    def installed(
        self,
        probes: Sequence[Any] | None,
        batchless: frozenset[int] = frozenset(),
        batch_size: int | None = None,
    ) -> Iterator[Probes]:
        """The probes on their layers for the block. With `probes=None` nothing is added
        (a first trace that records the probed shapes). The calls at the positions in
        `batchless` (in call order) are made on their input broadcast to `batch_size`
        examples (`batchless.py`)."""
        self._probes = probes
        with self.patched_calls(batchless, batch_size):
            yield self

    def call_tensors(self) -> list[dict[str, Any]]:
        """Per call of the pass being traced, its keyword arguments that hold tensors (a
        mask, a recurrent layer's initial states): the pass returns them (in its aux),
        so that they are values where the calls' records are read (`call_kwargs`)."""
        return [tensor_kwargs(kwargs) for _, _, kwargs in self.calls]

    def call_kwargs(self, tensors: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
        """Per call, `(index of its layer, its keyword arguments)`: the last trace's,
        those holding tensors from `tensors` (the `call_tensors` a pass returned)."""
        return [
            (index, {**kwargs, **found}) for (index, _, kwargs), found in zip(self.calls, tensors)
        ]

    def _add_probe(self, tensor: Any) -> Any:
        position = len(self.probed)
        self.probed.append(tensor)
        if self._probes is None:
            return tensor
        return tensor + self._probes[position].astype(tensor.dtype)

    def _probing_call(self, index: int, layer: Any) -> Any:
        original = layer.call

        def probing_call(*args: Any, **kwargs: Any) -> Any:
            args = self._recorded(index, layer, args, kwargs)
            if on_the_rule(layer):  # the probe goes on the gate pre-activations
                outputs, saved = recurrent_call(layer, original, args, kwargs, self._add_probe)
                self.calls[-1] = (index, saved, dict(kwargs))
                return outputs
            if splits_activation(layer):
                outputs, _ = marked_preactivation_call(
                    layer, original, args, kwargs, self._add_probe, "probed."
                )
                return outputs
            outputs = original(*args, **kwargs)
            leaves = jax.tree.leaves(outputs)
            if not leaves or not all(probed_output(leaf, leaves[0]) for leaf in leaves):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) returned "
                    f"{type(outputs).__name__}: the JAX engine probes layers whose output "
                    "is one float tensor, or several with a row per example."
                )
            if hasattr(outputs, "shape"):
                return self._add_probe(outputs)
            # Several outputs (a recurrent layer's sequence and states): one probe on
            # their rows side by side, as the per-layer fallback contracts them.
            return from_output_rows(self._add_probe(output_rows(outputs)), outputs)

        return probing_call
