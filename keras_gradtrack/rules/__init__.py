"""Per-layer rules, and the one registry that maps layer classes to them.

A rule turns one layer's calls (its inputs and the per-example gradients at its
pre-activation output) into the per-example primitives: without building
per-example gradient tensors, or, where those are as cheap as the batch gradient
(small parameters, long sequences, convolutions), by building them and taking
the batch gradient as their sum. Layers without a rule use the engine's exact,
vectorized per-layer fallback; `model.gradient_tracking_summary()` says which.

A rule registered for a class covers its subclasses too, as long as they keep
the class's `call`: a subclass that overrides `call` may compute something
else, so it goes to the fallback (exact, slower) until a rule is registered for
it. `register_rule(Subclass, rule)` does that, and replaces a built-in rule too.

Example:

```python
import keras, tensorflow as tf
import keras_gradtrack as kgt

class Scale(keras.layers.Layer):  # y = x * w, one weight per feature
    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[-1:], initializer="ones")

    def call(self, x):
        return x * self.w

def scale_per_example(layer, calls):
    grads = []
    for call in calls:  # both (B, ..., features), cast: float16 under mixed precision
        x, d = tf.cast(call.inputs, tf.float32), tf.cast(call.output_grad, tf.float32)
        grads.append(tf.reduce_sum(x * d, axis=list(range(1, len(x.shape) - 1))))
    return [(layer.w, tf.add_n(grads))]  # (B, *layer.w.shape), float32

kgt.register_rule(Scale, kgt.rules.Rule.from_per_example("scale", scale_per_example))
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_gradtrack.rule_table import resolved
from keras_gradtrack.rules.batch_normalization import BATCH_NORMALIZATION
from keras_gradtrack.rules.contract import (
    CrossFn,
    LayerCall,
    LayerPrimitives,
    PerExampleFn,
    Projection,
    Reference,
    Rule,
    RuleFn,
    SketchFn,
    Tapped,
)
from keras_gradtrack.rules.conv import CONV, DEPTHWISE_CONV
from keras_gradtrack.rules.conv_transpose import CONV_TRANSPOSE
from keras_gradtrack.rules.dense import DENSE
from keras_gradtrack.rules.einsum import EINSUM_DENSE
from keras_gradtrack.rules.embedding import EMBEDDING
from keras_gradtrack.rules.layer_scale import LAYER_SCALE
from keras_gradtrack.rules.lora import LORA_DENSE, LORA_EINSUM_DENSE, LORA_EMBEDDING
from keras_gradtrack.rules.normalization import (
    GROUP_NORMALIZATION,
    LAYER_NORMALIZATION,
    RMS_NORMALIZATION,
)
from keras_gradtrack.rules.ops import materialized, primitives_of
from keras_gradtrack.rules.prelu import PRELU
from keras_gradtrack.rules.recurrent import RECURRENT
from keras_gradtrack.rules.separable_conv import SEPARABLE_CONV

__all__ = [
    "BATCH_NORMALIZATION",
    "CONV",
    "CONV_TRANSPOSE",
    "DENSE",
    "DEPTHWISE_CONV",
    "EINSUM_DENSE",
    "EMBEDDING",
    "GROUP_NORMALIZATION",
    "LAYER_NORMALIZATION",
    "LAYER_SCALE",
    "LORA_DENSE",
    "LORA_EINSUM_DENSE",
    "LORA_EMBEDDING",
    "PRELU",
    "RECURRENT",
    "RMS_NORMALIZATION",
    "SEPARABLE_CONV",
    "CrossFn",
    "LayerCall",
    "LayerPrimitives",
    "PerExampleFn",
    "Projection",
    "Reference",
    "Rule",
    "RuleFn",
    "SketchFn",
    "Tapped",
    "materialized",
    "primitives_of",
    "register_rule",
]

# The built-in rules (the upper-case names of `__all__`), by name.
_BUILT_IN: dict[str, Rule] = {
    globals()[name].name: globals()[name] for name in __all__ if name.isupper()
}
# The classes of `rule_table` (which the JAX engine's registry reads too) with their
# built-in rules, and those `register_rule` adds or replaces; the rules for
# configurations a class's own rule leaves out (LoRA: `enable_lora`).
_REGISTRY, _CONFIGURATIONS = resolved(_BUILT_IN)


def register_rule(layer_class: type, rule: Rule | None) -> Rule | None:
    """Registers `rule` for `layer_class` and its subclasses that keep its `call`.

    Args:
        layer_class: A `keras.layers.Layer` subclass.
        rule: The `Rule`, or None to remove the class's rule (its layers then
            use the exact per-layer fallback, or a rule of a parent class).

    Returns:
        The rule registered for exactly this class before, or None.

    Raises:
        TypeError: If `layer_class` is not a Layer class or `rule` not a Rule.

    Example:

    ```python
    kgt.register_rule(MyDense, kgt.rules.DENSE)  # MyDense(Dense) overrides call, same math
    ```
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(
            f"Expected layer_class to be a keras.layers.Layer subclass. Received: {layer_class!r}"
        )
    if rule is not None and not isinstance(rule, Rule):
        raise TypeError(
            f"Expected rule to be a keras_gradtrack.rules.Rule or None. Received: {rule!r}"
        )
    previous = _REGISTRY.get(layer_class)
    if rule is None:
        _REGISTRY.pop(layer_class, None)
    else:
        _REGISTRY[layer_class] = rule
    return previous


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The rule found for a layer, or why there is none.

    Attributes:
        rule: The rule, or None (the layer uses the fallback).
        reason: Why there is no rule; empty when there is one.
        covers_sublayers: Whether the layer's column holds its sublayers'
            variables (`Rule.covers_sublayers` of the rule registered along its
            class's MRO, also when that rule does not apply to the layer).
    """

    rule: Rule | None
    reason: str = ""
    covers_sublayers: bool = False


def lookup(layer: Any) -> Lookup:
    """The rule for `layer`, along its class's MRO (see the module docstring).

    The engine's, not public API (not in `__all__`): the plan and
    `gradient_tracking_summary()` show which rule each layer takes."""
    mro = type(layer).__mro__
    for position, cls in enumerate(mro):
        rule = _REGISTRY.get(cls)
        if rule is None:
            continue
        overriding = [c.__name__ for c in mro[:position] if "call" in vars(c)]
        covers = rule.covers_sublayers
        if overriding:
            return Lookup(
                None,
                f"{overriding[0]} overrides the call() of {cls.__name__}, whose rule "
                f"{rule.name!r} may not hold for it; register_rule({overriding[0]}, rule) "
                "if its call computes the same",
                covers,
            )
        if not rule.applies(layer):
            for configuration in _CONFIGURATIONS.get(cls, ()):
                if configuration.applies(layer):
                    return Lookup(configuration, covers_sublayers=covers)
            mode = getattr(layer, "quantization_mode", None)
            what = f"quantized weights ({mode})" if mode else "this configuration"
            return Lookup(None, f"rule {rule.name!r} does not cover {what}", covers)
        return Lookup(rule, covers_sublayers=covers)
    return Lookup(None, f"no rule registered for {type(layer).__name__}")
