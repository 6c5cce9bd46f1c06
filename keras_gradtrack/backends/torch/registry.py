"""The PyTorch engine's rule registry: the rules written once in `keras.ops`, the
recurrent rule (`ops/recurrent.py`) among them.

BatchNormalization in training has a rule of the JAX engine's own (inside its traced
step); on PyTorch the plan refuses it (`plan.refusal`), so its rule is absent here.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
```
"""

from __future__ import annotations

from keras_gradtrack.backends.ops.recurrent import RECURRENT
from keras_gradtrack.backends.ops.registry import SHARED_RULES, Registry

REGISTRY = Registry(
    {rule.name: rule for rule in (*SHARED_RULES, RECURRENT)},
    absent=frozenset({"batch_normalization"}),
)
lookup = REGISTRY.lookup
