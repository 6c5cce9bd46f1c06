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

    BACKEND = "JAX"

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

    def _probed_output(self, leaf: Any, first: Any) -> bool:
        return probed_output(leaf, first)

    def _probe(self, tensor: Any) -> Any:
        position = len(self.probed)
        self.probed.append(tensor)
        if self._probes is None:
            return tensor
        return tensor + self._probes[position].astype(tensor.dtype)
