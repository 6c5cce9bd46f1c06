"""Refusals every engine makes in the same words (TensorFlow, JAX, PyTorch); plain Python.

Example:

```python
raise ValueError(uncalled_layers_message(["unused"]))
```
"""

from __future__ import annotations

from collections.abc import Sequence


def uncalled_layers_message(names: Sequence[str]) -> str:
    """Why a step whose forward pass did not call the tracked layers `names` is refused
    (built, with trainable variables, but not run: their rules have no inputs and
    output gradients)."""
    return (
        f"This step's forward pass did not call the tracked layers {list(names)} (built, "
        "with trainable variables, but not run by the model's `call` on this batch), "
        "so the rules have no inputs and output gradients for them. Freeze them "
        "(`layer.trainable = False`) or remove them; in a `train_step` of one's own, "
        "run the model (`self(x, training=True)`) before differentiating the loss."
    )
