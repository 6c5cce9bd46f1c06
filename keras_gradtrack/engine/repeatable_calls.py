"""Which recurrent layers the exact per-layer fallback cannot run, on every backend.

Off a rule, a recurrent layer runs on the exact per-layer fallback, which calls the
layer a second time (on the inputs the step recorded, or on each example): exact for
any cell, provided that second call computes what the step's computed. Two settings
break that, and both engines refuse them with this message before any weight
changes: a `stateful` layer (its states hold the whole batch between calls, and a
second call advances them again) and dropout in its cell (a second call draws other
masks than the step's). Plain Keras and `keras.ops` only: the TensorFlow plan and the
JAX plan both read it.

Example:

```python
refusal = unrepeatable_call(layer, "ConvLSTM overrides the call()")
if refusal:
    raise ValueError(refusal)
```
"""

from __future__ import annotations

from typing import Any

from keras_gradtrack._keras_seam import flatten_layers


def unrepeatable_call(layer: Any, reason: str) -> str:
    """Why the fallback cannot repeat the call of `layer`, a recurrent layer without a
    rule (`reason`: why it has none), as the refusal's message; empty when it can."""
    cell = getattr(layer, "cell", None)
    if cell is None:
        return ""
    dropped = [
        f"{type(inner).__name__}.{attribute}={getattr(inner, attribute)}"
        for inner in flatten_layers(cell)
        for attribute in ("dropout", "recurrent_dropout")
        if isinstance(getattr(inner, attribute, None), (int, float))
        and getattr(inner, attribute) > 0
    ]
    if getattr(layer, "stateful", False):
        setting = "stateful=True (its states hold the whole batch between calls)"
    elif dropped:
        setting = f"dropout in its cell ({', '.join(dropped)})"
    else:
        return ""
    return (
        f"Layer {layer.name!r} ({type(layer).__name__}, cell {type(cell).__name__}) has no "
        f"rule ({reason}), so the exact fallback would run its call a second time, and "
        f"with {setting} that second run differs from the first. Use a built-in "
        "SimpleRNN, LSTM or GRU cell with every cell weight trained (their rule runs the "
        "call once), or drop that option."
    )
