"""The JAX engine's rule registry: the shared rules (`backends/ops/`), and those of JAX's own.

BatchNormalization in training (opted in) and the recurrent layers inside their
`lax.scan` have rules of the JAX engine's own; every other rule is written once in
`keras.ops` (`ops.registry.SHARED_RULES`). How a class finds its rule, and how rules
registered with `kgt.register_rule` apply, is `ops.registry.Registry`.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
lookup(keras.layers.PReLU())          # PRELU
```
"""

from __future__ import annotations

from keras_gradtrack.backends.ops import batch_normalization, recurrent
from keras_gradtrack.backends.ops.registry import SHARED_RULES, Registry
from keras_gradtrack.rule_table import NO_JAX_RULE

REGISTRY = Registry(
    {
        rule.name: rule
        for rule in (
            *SHARED_RULES,
            batch_normalization.BATCH_NORMALIZATION,
            recurrent.RECURRENT,
        )
    },
    absent=NO_JAX_RULE,
)
lookup = REGISTRY.lookup
