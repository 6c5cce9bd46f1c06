"""The one way the package swaps an attribute for a block and puts it back exactly.

A tracked step is traced with a few of Keras' objects changed for the duration of
the trace: a layer's `call` and `activation` (the taps), BatchNormalization's
`call` (the coupling recorder), a recurrent layer's `inner_loop` (its rule), each
regularized variable's `regularizer`, the optimizer's `scale_loss`, the compiled
loss' metrics' `update_state`, and, process-wide, `keras.src.losses.loss.
reduce_values` (the loss recorder; see `engine/losses.py` for its scope). Each goes
through `patched`, which restores what was there: the object's own attribute if it
had one, else nothing, so that the class's shows again (an instance attribute left
behind would shadow a method the class later changes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

_MISSING = object()


@contextlib.contextmanager
def patched(target: Any, name: str, value: Any) -> Iterator[Any]:
    """Sets `target.<name>` to `value` for the block, then restores it exactly.

    Args:
        target: An object (a layer, a variable, an optimizer) or a module.
        name: The attribute.
        value: What it is for the block.

    Yields:
        What the attribute was before (the class's method, for a method).

    Example:

    ```python
    with patched(layer, "activation", recording_activation) as activation:
        outputs = layer.call(x)
    ```
    """
    before = getattr(target, name)
    own = vars(target).get(name, _MISSING) if hasattr(target, "__dict__") else _MISSING
    # A property (a variable's `regularizer`) is set and restored through its setter.
    descriptor = isinstance(getattr(type(target), name, None), property)
    if descriptor or own is not _MISSING:
        setattr(target, name, value)
    else:
        # Written into the instance's own dict: Keras' `__setattr__` would track it.
        vars(target)[name] = value
    try:
        yield before
    finally:
        if descriptor:
            setattr(target, name, before)
        elif own is _MISSING:
            vars(target).pop(name, None)
        else:
            vars(target)[name] = own


@contextlib.contextmanager
def patched_each(changes: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """`patched` for each `(target, name, value)`, all restored when the block ends."""
    with contextlib.ExitStack() as stack:
        for target, name, value in changes:
            stack.enter_context(patched(target, name, value))
        yield
