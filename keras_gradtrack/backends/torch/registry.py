"""The PyTorch engine's rule registry: the rules written once in `keras.ops`, the
recurrent rule (`ops/recurrent.py`) and BatchNormalization's (`ops/batch_normalization.py`,
in training where the model opts in: `coupled.py`) among them; Dense's direct form and the
convolutions' per-example gradients run as torch kernels of the same math (`kernels.py`).

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
```
"""

from __future__ import annotations

from keras_gradtrack.backends.ops.batch_normalization import BATCH_NORMALIZATION
from keras_gradtrack.backends.ops.recurrent import RECURRENT
from keras_gradtrack.backends.ops.registry import SHARED_RULES, Registry
from keras_gradtrack.backends.torch import kernels

# The shared rules, with the torch kernels where they are faster (`kernels.py`).
RULES = (*SHARED_RULES, BATCH_NORMALIZATION, RECURRENT, *kernels.RULES)
REGISTRY = Registry({rule.name: rule for rule in RULES})
lookup = REGISTRY.lookup
