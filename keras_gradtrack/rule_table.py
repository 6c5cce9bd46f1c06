"""Which built-in rule covers which Keras layer class, by the rule's name: one table
that both engines' registries read.

Data only, in Keras and plain Python (no TensorFlow, no JAX): the TensorFlow
registry (`rules/__init__.py`) maps each name to its `Rule`, the JAX engine's
(`backends/jax/registry.py`) to its `ProbedRule`; the layers of `NO_JAX_RULE`'s rules
run on the JAX engine's exact per-layer fallback. A class's rule covers its
subclasses that keep its `call` (each registry's `lookup`).

Example:

```python
LAYER_RULES[keras.layers.Conv2D]           # "conv"
CONFIGURATION_RULES[keras.layers.Dense]    # ("lora_dense",)
registry, configurations = resolved({rule.name: rule for rule in built_in_rules})
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import keras

from keras_gradtrack._keras_seam import LayerScale

LAYER_RULES: dict[type, str] = {
    keras.layers.Dense: "dense",
    keras.layers.EinsumDense: "einsum_dense",
    keras.layers.Embedding: "embedding",
    keras.layers.Conv1D: "conv",
    keras.layers.Conv2D: "conv",
    keras.layers.Conv3D: "conv",
    keras.layers.DepthwiseConv1D: "depthwise_conv",
    keras.layers.DepthwiseConv2D: "depthwise_conv",
    keras.layers.SeparableConv1D: "separable_conv",
    keras.layers.SeparableConv2D: "separable_conv",
    keras.layers.Conv1DTranspose: "conv_transpose",
    keras.layers.Conv2DTranspose: "conv_transpose",
    keras.layers.Conv3DTranspose: "conv_transpose",
    keras.layers.LayerNormalization: "layer_normalization",
    keras.layers.RMSNormalization: "rms_normalization",
    keras.layers.GroupNormalization: "group_normalization",
    keras.layers.BatchNormalization: "batch_normalization",
    keras.layers.PReLU: "prelu",
    LayerScale: "layer_scale",
    # On JAX the plan refuses the recurrent layers this rule does not cover
    # (`backends/ops/recurrent.py`).
    keras.layers.RNN: "recurrent",
    keras.layers.SimpleRNN: "recurrent",
    keras.layers.LSTM: "recurrent",
    keras.layers.GRU: "recurrent",
}

# Rules for configurations the class's own rule leaves out: LoRA (`enable_lora`).
CONFIGURATION_RULES: dict[type, tuple[str, ...]] = {
    keras.layers.Dense: ("lora_dense",),
    keras.layers.EinsumDense: ("lora_einsum_dense",),
    keras.layers.Embedding: ("lora_embedding",),
}

# The rules the JAX engine does not have: their layers take its fallback there.
NO_JAX_RULE: frozenset[str] = frozenset()

RuleT = TypeVar("RuleT")


def resolved(
    by_name: Mapping[str, RuleT], absent: frozenset[str] = frozenset()
) -> tuple[dict[type, RuleT], dict[type, tuple[RuleT, ...]]]:
    """`(registry, configurations)`: `LAYER_RULES` and `CONFIGURATION_RULES` with each
    name replaced by its rule in `by_name`, leaving out the classes whose rule is one
    of `absent` (their layers take the engine's fallback).

    Raises:
        KeyError: For a name of the table (not `absent`) that `by_name` lacks.
    """
    registry = {cls: by_name[name] for cls, name in LAYER_RULES.items() if name not in absent}
    configurations = {
        cls: tuple(by_name[name] for name in names) for cls, names in CONFIGURATION_RULES.items()
    }
    return registry, configurations
