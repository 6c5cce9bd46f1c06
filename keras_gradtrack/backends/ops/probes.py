"""What the probed engines' probes share: the record of each tracked call, the calls
without the batch's rows, and installing a backend's probing `call` on every layer.

A backend's `Probes` subclasses `ProbeRecords` with `_probe(tensor)`, what a probed
output becomes (JAX adds a zero probe to it, PyTorch keeps the output itself), and
`_probed_output(leaf, first)`, which outputs its probes can mark; the probing `call`
that records `(index, input, kwargs)` in `calls` and each probed output in `probed` is
written here once.

Example:

```python
with probes.patched_calls(batchless, batch_size):
    model(x)
probes.calls     # [(layer position, its input, its kwargs), ...] in call order
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from keras import tree

from keras_gradtrack._patching import patched
from keras_gradtrack.backends.ops.batchless import broadcast_to_batch
from keras_gradtrack.backends.ops.recurrent import (
    from_output_rows,
    on_the_rule,
    output_rows,
    recurrent_call,
)
from keras_gradtrack.backends.ops.rules import splits_activation
from keras_gradtrack.engine.preactivation import marked_preactivation_call


class ProbeRecords:
    """The calls of `layers` in a pass and their probed tensors.

    Args:
        layers: The tracked layers.
    """

    def __init__(self, layers: Sequence[Any]):
        self.layers = list(layers)
        self.calls: list[tuple[int, Any, dict[str, Any]]] = []
        self.probed: list[Any] = []
        self._batchless: frozenset[int] = frozenset()
        self._batch_size: int | None = None

    @contextlib.contextmanager
    def patched_calls(
        self, batchless: frozenset[int] = frozenset(), batch_size: int | None = None
    ) -> Iterator[None]:
        """Every layer's `call` the backend's probing one for the block, the records
        emptied; the calls at the positions in `batchless` (in call order) are made on
        their input broadcast to `batch_size` examples (`batchless.py`)."""
        self.calls, self.probed = [], []
        self._batchless, self._batch_size = batchless, batch_size
        with contextlib.ExitStack() as stack:
            for index, layer in enumerate(self.layers):
                stack.enter_context(patched(layer, "call", self._probing_call(index, layer)))
            yield

    def _recorded(self, index: int, layer: Any, args: tuple[Any, ...], kwargs: Any) -> tuple:
        """The call's arguments (its input broadcast where it is batchless), recorded."""
        if not args:
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) was called without a "
                "positional input: the engine tracks a layer's first argument."
            )
        if len(self.calls) in self._batchless:
            assert self._batch_size is not None
            args = (broadcast_to_batch(args[0], self._batch_size), *args[1:])
        self.calls.append((index, args[0], dict(kwargs)))
        return args

    # The engine's name in the refusal of an output it cannot probe.
    BACKEND = ""

    def _probe(self, tensor: Any) -> Any:
        """The probed output in the pass, recorded in `probed`."""
        raise NotImplementedError

    def _probed_output(self, leaf: Any, first: Any) -> bool:
        """Whether a layer's output tensor can be probed (`first`: its first output)."""
        raise NotImplementedError

    def _probing_call(self, index: int, layer: Any) -> Any:
        """The layer's `call`, recording the call and probing its (pre-activation)
        output: a recurrent layer on its rule at its gates' pre-activations, several
        outputs as one probe on their rows side by side (as the fallback contracts
        them), from which the layer's outputs are read again so the loss reaches them."""
        original = layer.call

        def probing_call(*args: Any, **kwargs: Any) -> Any:
            args = self._recorded(index, layer, args, kwargs)
            if on_the_rule(layer):
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
            if not leaves or not all(self._probed_output(leaf, leaves[0]) for leaf in leaves):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) returned "
                    f"{type(outputs).__name__}: the {self.BACKEND} engine probes layers "
                    "whose output is one float tensor, or several with a row per example."
                )
            if hasattr(outputs, "shape"):
                return self._probe(outputs)
            return from_output_rows(self._probe(output_rows(outputs)), outputs)

        return probing_call


def preactivation_call(
    layer: Any, trainable: Sequence[Any], others: Sequence[Any], x: Any, kwargs: Any
) -> Any:
    """The layer's output before its activation, as a stateless call on `trainable`
    values; several outputs as the probe sees them (`output_rows`): what the backends'
    fallbacks and local VJPs differentiate."""
    if splits_activation(layer):
        with patched(layer, "activation", None):
            outputs, _ = layer.stateless_call(trainable, others, x, **kwargs)
    else:
        outputs, _ = layer.stateless_call(trainable, others, x, **kwargs)
    return output_rows(outputs)
