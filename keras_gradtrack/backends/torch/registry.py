"""The PyTorch engine's rule registry: the rules written once in `keras.ops`, the
recurrent rule (`ops/recurrent.py`) and BatchNormalization's (`ops/batch_normalization.py`,
in training where the model opts in: `coupled.py`) among them.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
```
"""

from __future__ import annotations

from keras_gradtrack.backends.ops.batch_normalization import BATCH_NORMALIZATION
from keras_gradtrack.backends.ops.recurrent import RECURRENT
from keras_gradtrack.backends.ops.registry import SHARED_RULES, Registry

REGISTRY = Registry({rule.name: rule for rule in (*SHARED_RULES, BATCH_NORMALIZATION, RECURRENT)})
lookup = REGISTRY.lookup
