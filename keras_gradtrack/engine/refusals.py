"""Refusals every engine makes in the same words (TensorFlow, JAX, PyTorch); plain Python.

Example:

```python
refuse_uncalled_layers(plan, called={0, 2})  # raises naming plan[1] and plan[3]
```
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any


def uncalled_names(plan: Sequence[Any], called: Collection[int]) -> list[str]:
    """The names of the tracked layers of `plan` (in its order) whose index is not in
    `called`, the indexes of the layers a forward pass called."""
    return [tracked.name for index, tracked in enumerate(plan) if index not in called]


def refuse_uncalled_layers(plan: Sequence[Any], called: Collection[int]) -> None:
    """Refuses a step whose forward pass called only the tracked layers `called` (indexes
    into `plan`).

    Raises:
        ValueError: Naming the layers not called (built, with trainable variables, but
            not run by the step's forward pass: their rules have no input and output
            gradient).
    """
    uncalled = uncalled_names(plan, called)
    if uncalled:
        raise ValueError(uncalled_layers_message(uncalled))


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
