"""The JAX engine's rule registry: which rule covers which layer class.

A rule registered for a class covers its subclasses that keep the class's `call`
and that its `applies` accepts; any other layer with weights runs on the exact
per-layer fallback, and its path says so.

Rules registered with `kgt.register_rule` (the one public registry,
`keras_gradtrack.rules`) apply here too: a built-in rule registered for another
class (`register_rule(MyDense, kgt.rules.DENSE)`) is the JAX engine's rule of the
same name, where it has one; a rule of the user's own runs through its
`per_example` function, called with JAX arrays (`LayerCall.inputs` and
`output_grad`) inside a `keras.StatelessScope` holding the step's weights: a rule
written in `keras.ops` runs on both backends. A rule without `per_example`, or
one that fails on JAX arrays (TensorFlow ops), is refused with an error naming it.

Example:

```python
lookup(keras.layers.Conv2D(4, 3))     # CONV
lookup(keras.layers.PReLU())          # None: the fallback
```
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import keras

from keras_gradtrack.backends.jax import batch_normalization, conv, normalization, recurrent
from keras_gradtrack.backends.jax import rules as jax_rules
from keras_gradtrack.backends.jax.rules import JaxRule, ProbedCall, f32
from keras_gradtrack.rule_table import NO_JAX_RULE, resolved

BY_NAME: dict[str, JaxRule] = {
    rule.name: rule
    for rule in (
        jax_rules.DENSE,
        jax_rules.EINSUM_DENSE,
        jax_rules.EMBEDDING,
        jax_rules.LORA_DENSE,
        jax_rules.LORA_EINSUM_DENSE,
        jax_rules.LORA_EMBEDDING,
        conv.CONV,
        conv.DEPTHWISE_CONV,
        conv.SEPARABLE_CONV,
        conv.CONV_TRANSPOSE,
        jax_rules.PRELU,
        jax_rules.LAYER_SCALE,
        normalization.LAYER_NORMALIZATION,
        normalization.RMS_NORMALIZATION,
        normalization.GROUP_NORMALIZATION,
        batch_normalization.BATCH_NORMALIZATION,
        recurrent.RECURRENT,
    )
}
# The classes of `rule_table` (which the public registry reads too) whose rule the JAX
# engine has, and the rules for configurations their own rule leaves out (LoRA).
REGISTRY, CONFIGURATIONS = resolved(BY_NAME, absent=NO_JAX_RULE)
PUBLIC_REGISTRY = "keras_gradtrack.rules"


def lookup(layer: Any) -> JaxRule | None:
    """The layer's rule: one registered with `kgt.register_rule` (see the module), else
    the rule of the layer's class, or of the nearest base class whose `call` it keeps,
    if the rule applies to the layer.

    Raises:
        ValueError: For a rule registered with `kgt.register_rule` that cannot run on JAX
            (it has no `per_example` function).
    """
    registered = registered_rule(layer)
    if registered is not None:
        return registered
    return own_lookup(layer)


def registered_rule(layer: Any) -> JaxRule | None:
    """The JAX form of the rule `kgt.register_rule` gave the layer, where that is not
    the JAX engine's own choice; None otherwise (and while nothing imported the
    public registry, which imports TensorFlow)."""
    rules = sys.modules.get(PUBLIC_REGISTRY)
    if rules is None:
        return None
    found = rules.lookup(layer).rule
    if found is None:
        return None
    built_in = {id(getattr(rules, name)) for name in rules.__all__ if name.isupper()}
    if id(found) in built_in:
        own = own_lookup(layer)
        same = BY_NAME.get(found.name)
        if own is not None or same is None or (same.applies and not same.applies(layer)):
            return own
        return same
    return adapted(found, layer)


def adapted(rule: Any, layer: Any) -> JaxRule:
    """A rule of the public registry, run on JAX through its `per_example` function."""
    if rule.per_example is None:
        raise ValueError(
            f"Rule {rule.name!r}, registered for {type(layer).__name__} with "
            "kgt.register_rule, computes the primitives only (TensorFlow tensors and "
            "References); on the JAX backend a registered rule runs through its "
            "per_example function (`Rule.from_per_example(name, per_example)`, written in "
            f"keras.ops). Received: Rule(name={rule.name!r}, per_example=None)"
        )

    def per_example(
        layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any]
    ) -> list[Any]:
        # The public registry is loaded (the rule came from it): its contract's call.
        contract_call = sys.modules[PUBLIC_REGISTRY].LayerCall(
            args=(call.inputs,), kwargs=call.kwargs, output_grads=(call.output_grad,)
        )
        mapping = [
            *zip(layer.trainable_variables, values),
            *zip(layer.non_trainable_variables, others),
        ]
        try:
            with keras.StatelessScope(state_mapping=mapping):
                pairs = rule.per_example(layer, [contract_call])
            by_variable = {id(variable): grad for variable, grad in pairs}
            batch = call.output_grad.shape[0]
            return [
                f32(by_variable[id(v)]).reshape((batch, *v.shape))
                for v in layer.trainable_variables
            ]
        except Exception as error:
            raise ValueError(
                f"Rule {rule.name!r}, registered for {type(layer).__name__} with "
                "kgt.register_rule, failed on the JAX backend: its per_example function "
                "receives JAX arrays there and returns one (B, *variable.shape) gradient per "
                "trainable variable of the layer; a rule written in keras.ops runs on both "
                f"backends (TensorFlow ops do not run on JAX). Received: {error!r}"
            ) from error

    return JaxRule(rule.name, per_example, applies=rule.applies)


def own_lookup(layer: Any) -> JaxRule | None:
    """The JAX engine's own rule of the layer's class, or of the nearest base class
    whose `call` it keeps, if the rule applies to the layer (or one of
    `CONFIGURATIONS` for the class does)."""
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
