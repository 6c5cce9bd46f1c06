"""The PyTorch engine's rule registry: the rules written once in `keras.ops`.

BatchNormalization in training and the recurrent layers have rules of the JAX
engine's own (inside its traced step); on PyTorch the plan refuses them
(`plan.refusal`), so their rules are absent here.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
```
"""

from __future__ import annotations

from keras_gradtrack.backends.ops.registry import SHARED_RULES, Registry

REGISTRY = Registry(
    {rule.name: rule for rule in SHARED_RULES},
    absent=frozenset({"batch_normalization", "recurrent"}),
)
lookup = REGISTRY.lookup
