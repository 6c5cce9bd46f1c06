"""The rule for PReLU: `y = max(x, 0) + alpha * min(x, 0)`, `alpha` per input value
(of size one along the `shared_axes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_gradtrack import rule_math
from keras_gradtrack.rules.contract import LayerCall, Rule


def prelu_per_example(layer: Any, calls: Sequence[LayerCall]) -> list[tuple[Any, Any]]:
    """Per-example gradients of `alpha`: `d_i * min(x_i, 0)`, summed along the shared axes."""
    grads = [
        rule_math.prelu_gradients(call.inputs, call.output_grad, layer.shared_axes)
        for call in calls
    ]
    return [(layer.alpha, rule_math.total(grads))]


PRELU = Rule.from_per_example("prelu", prelu_per_example)
