"""A probed engine's rule registry: which rule covers which layer class.

A rule registered for a class covers its subclasses that keep the class's `call`
and that its `applies` accepts; any other layer with weights runs on the backend's
exact per-layer fallback, and its path says so.

Rules registered with `kgt.register_rule` (the one public registry,
`keras_gradtrack.rules`) apply here too: a built-in rule registered for another
class (`register_rule(MyDense, kgt.rules.DENSE)`) is the engine's rule of the same
name, where it has one; a rule of the user's own runs through its `per_example`
function, called with the backend's tensors (`LayerCall.inputs` and `output_grad`)
inside a `keras.StatelessScope` holding the step's weights: a rule written in
`keras.ops` runs on every backend. A rule without `per_example`, or one that fails
on the backend's tensors (TensorFlow ops), is refused with an error naming it.

Example:

```python
registry = Registry({rule.name: rule for rule in rules}, absent=frozenset({"recurrent"}))
registry.lookup(keras.layers.Conv2D(4, 3))     # CONV
```
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from keras_gradtrack.backends.ops import conv, normalization
from keras_gradtrack.backends.ops import rules as ops_rules
from keras_gradtrack.backends.ops.rules import ProbedCall, ProbedRule, backend_name
from keras_gradtrack.rule_math import f32
from keras_gradtrack.rule_table import resolved

PUBLIC_REGISTRY = "keras_gradtrack.rules"

# The rules written once in `keras.ops`, every probed engine's.
SHARED_RULES: tuple[ProbedRule, ...] = (
    ops_rules.DENSE,
    ops_rules.EINSUM_DENSE,
    ops_rules.EMBEDDING,
    ops_rules.LORA_DENSE,
    ops_rules.LORA_EINSUM_DENSE,
    ops_rules.LORA_EMBEDDING,
    conv.CONV,
    conv.DEPTHWISE_CONV,
    conv.SEPARABLE_CONV,
    conv.CONV_TRANSPOSE,
    ops_rules.PRELU,
    ops_rules.LAYER_SCALE,
    normalization.LAYER_NORMALIZATION,
    normalization.RMS_NORMALIZATION,
    normalization.GROUP_NORMALIZATION,
)


class Registry:
    """One backend's rules by layer class (`rule_table`), and the public registry's.

    Args:
        by_name: The backend's rules by name.
        absent: The table's rule names the backend has no rule for (their layers
            take its fallback, or its plan refuses them).
    """

    def __init__(self, by_name: Mapping[str, ProbedRule], absent: frozenset[str] = frozenset()):
        self.by_name = dict(by_name)
        self.classes, self.configurations = resolved(self.by_name, absent=absent)

    def lookup(self, layer: Any) -> ProbedRule | None:
        """The layer's rule: one registered with `kgt.register_rule` (see the module), else
        the rule of the layer's class, or of the nearest base class whose `call` it keeps,
        if the rule applies to the layer.

        Raises:
            ValueError: For a rule registered with `kgt.register_rule` that cannot run on the backend
                (it has no `per_example` function).
        """
        registered = self.registered_rule(layer)
        if registered is not None:
            return registered
        return self.own_lookup(layer)

    def registered_rule(self, layer: Any) -> ProbedRule | None:
        """The engine's form of the rule `kgt.register_rule` gave the layer, where that is not
        the engine's own choice; None otherwise (and while nothing imported the
        public registry, which imports TensorFlow)."""
        rules = sys.modules.get(PUBLIC_REGISTRY)
        if rules is None:
            return None
        found = rules.lookup(layer).rule
        if found is None:
            return None
        built_in = {id(getattr(rules, name)) for name in rules.__all__ if name.isupper()}
        if id(found) in built_in:
            own = self.own_lookup(layer)
            same = self.by_name.get(found.name)
            if own is not None or same is None or (same.applies and not same.applies(layer)):
                return own
            return same
        return adapted(found, layer)

    def own_lookup(self, layer: Any) -> ProbedRule | None:
        """The engine's own rule of the layer's class, or of the nearest base class
        whose `call` it keeps, if the rule applies to the layer (or one of
        `CONFIGURATIONS` for the class does)."""
        for cls in type(layer).__mro__:
            rule = self.classes.get(cls)
            if rule is not None:
                if getattr(type(layer), "call", None) is not getattr(cls, "call", None):
                    return None
                for candidate in (rule, *self.configurations.get(cls, ())):
                    if candidate.applies is None or candidate.applies(layer):
                        return candidate
                return None
        return None


def adapted(rule: Any, layer: Any) -> ProbedRule:
    """A rule of the public registry, run through its `per_example` function."""
    if rule.per_example is None:
        raise ValueError(
            f"Rule {rule.name!r}, registered for {type(layer).__name__} with "
            "kgt.register_rule, computes the primitives only (TensorFlow tensors and "
            f"References); on the {backend_name()} backend a registered rule runs through its "
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
                ops.reshape(f32(by_variable[id(v)]), (batch, *v.shape))
                for v in layer.trainable_variables
            ]
        except Exception as error:
            raise ValueError(
                f"Rule {rule.name!r}, registered for {type(layer).__name__} with "
                f"kgt.register_rule, failed on the {backend_name()} backend: its per_example "
                "function receives that backend's tensors there and returns one (B, *variable.shape) gradient per "
                "trainable variable of the layer; a rule written in keras.ops runs on every "
                f"backend (TensorFlow ops do not run on the others). Received: {error!r}"
            ) from error

    return ProbedRule(rule.name, per_example, applies=rule.applies)
