"""The columns of `OutputGradientLogger` on the probed engines (JAX, PyTorch): a
tracking model's plan, else each layer with trainable variables of its own.

Example:

```python
for layer, variables in output_columns(model):
    ...
```
"""

from __future__ import annotations

from typing import Any

from keras_gradtrack._keras_seam import flatten_layers, own_trainable_variables


def output_columns(model: Any) -> list[tuple[Any, list[Any]]]:
    """`(layer, its variables)` per column: a tracking model's plan (as the per-example
    columns), else every layer with trainable variables of its own, in the order of
    `model.trainable_variables`."""
    if hasattr(model, "gradient_tracking_plan"):
        return [(t.layer, list(t.variables)) for t in model.gradient_tracking_plan()]
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    groups = []
    for layer in flatten_layers(model, include_self=False):
        own = [v for v in own_trainable_variables(layer) if id(v) in position]
        if own:
            groups.append((layer, sorted(own, key=lambda v: position[id(v)])))
    return sorted(groups, key=lambda group: position[id(group[1][0])])
