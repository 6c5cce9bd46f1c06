"""A layer's pre-activation output, reached through its `activation`; no backend imported.

A layer whose `call` ends in `self.activation(z)` (Dense, Conv, EinsumDense) has
its per-example gradient at `z`, not at its output. Both engines reach `z` the
same way: the call runs with `activation` swapped for one that marks `z` (the
TensorFlow taps record it, the JAX probes add a zero to it) and then applies the
layer's own activation. A `call` that applies `activation` other than once has no
one pre-activation output, and is refused.

Example:

```python
outputs, z = marked_preactivation_call(layer, layer.call, (x,), {}, lambda z: z, "tapped.")
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_gradtrack._patching import patched


def marked_preactivation_call(
    layer: Any,
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mark: Callable[[Any], Any],
    refusal: str,
) -> tuple[Any, Any]:
    """`(outputs, z)`: `call(*args, **kwargs)` with the layer's `activation(z)` replaced
    by `activation(mark(z))`, and the pre-activation output `z` it was applied to.

    Args:
        layer: The layer; its `activation` is restored when the call ends.
        call: The layer's original `call`.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        mark: What becomes of `z` before the activation (the identity, or `z` plus a
            zero probe).
        refusal: The end of the error's message: why the step needs `z`, what to do.

    Raises:
        RuntimeError: When `call` applied `activation` other than once.
    """
    activation = layer.activation
    preactivations: list[Any] = []

    def marking_activation(z: Any) -> Any:
        preactivations.append(z)
        return activation(mark(z))

    with patched(layer, "activation", marking_activation):
        outputs = call(*args, **kwargs)
    if len(preactivations) != 1:
        raise RuntimeError(
            f"Layer {layer.name!r} ({type(layer).__name__}) applied its "
            f"`activation` {len(preactivations)} times in `call` (expected once), so "
            f"its pre-activation output cannot be {refusal}"
        )
    return outputs, preactivations[0]
