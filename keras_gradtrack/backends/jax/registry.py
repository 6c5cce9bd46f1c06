"""The JAX engine's rule registry: which rule covers which layer class.

A rule registered for a class covers its subclasses that keep the class's `call`
and that its `applies` accepts; any other layer with weights runs on the exact
per-layer fallback, and its path says so.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
lookup(keras.layers.PReLU())          # None: the fallback
```
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.jax.conv import CONV, DEPTHWISE_CONV, SEPARABLE_CONV
from keras_gradtrack.backends.jax.normalization import (
    GROUP_NORMALIZATION,
    LAYER_NORMALIZATION,
    RMS_NORMALIZATION,
)
from keras_gradtrack.backends.jax.rules import (
    DENSE,
    EINSUM_DENSE,
    EMBEDDING,
    LORA_DENSE,
    LORA_EINSUM_DENSE,
    LORA_EMBEDDING,
    JaxRule,
)

REGISTRY: dict[type, JaxRule] = {
    keras.layers.Dense: DENSE,
    keras.layers.EinsumDense: EINSUM_DENSE,
    keras.layers.Embedding: EMBEDDING,
    keras.layers.Conv1D: CONV,
    keras.layers.Conv2D: CONV,
    keras.layers.Conv3D: CONV,
    keras.layers.DepthwiseConv1D: DEPTHWISE_CONV,
    keras.layers.DepthwiseConv2D: DEPTHWISE_CONV,
    keras.layers.SeparableConv1D: SEPARABLE_CONV,
    keras.layers.SeparableConv2D: SEPARABLE_CONV,
    keras.layers.LayerNormalization: LAYER_NORMALIZATION,
    keras.layers.RMSNormalization: RMS_NORMALIZATION,
    keras.layers.GroupNormalization: GROUP_NORMALIZATION,
}

# Rules for configurations the class's own rule leaves out: LoRA (`enable_lora`).
CONFIGURATIONS: dict[type, tuple[JaxRule, ...]] = {
    keras.layers.Dense: (LORA_DENSE,),
    keras.layers.EinsumDense: (LORA_EINSUM_DENSE,),
    keras.layers.Embedding: (LORA_EMBEDDING,),
}


def lookup(layer: Any) -> JaxRule | None:
    """The rule of the layer's class, or of the nearest base class whose `call` it keeps,
    if the rule applies to the layer (or one of `CONFIGURATIONS` for the class does)."""
    for cls in type(layer).__mro__:
        rule = REGISTRY.get(cls)
        if rule is not None:
            if getattr(type(layer), "call", None) is not getattr(cls, "call", None):
                return None
            for candidate in (rule, *CONFIGURATIONS.get(cls, ())):
                if candidate.applies is None or candidate.applies(layer):
                    return candidate
            return None
    return None
