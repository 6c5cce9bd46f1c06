"""A column of the per-layer statistics: the tracked layer every engine's plan lists.

Backend-free: the TensorFlow engine's plan (`engine/plan.py`) and the probed engines'
(`backends/ops/plan.py`) build the same record, each with its own rules and its own
fallback's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# The TensorFlow engine's fallback, as a layer's path names it.
FALLBACK_PATH = "fallback (per-layer vectorized Jacobian)"


@dataclasses.dataclass(frozen=True)
class TrackedLayer:
    """One column of the per-layer statistics.

    Attributes:
        name: Column name (the layer's name, made unique within the model).
        layer: The Keras layer.
        variables: The layer's own trainable variables (not its sublayers', unless
            its rule covers them: `Rule.covers_sublayers`; on a probed engine a
            recurrent layer's column holds its cell's).
        rule: The rule computing its primitives (the engine's kind: `Rule`,
            `ProbedRule`), or None for the engine's exact per-layer fallback.
        reason: Why the layer has no rule (empty when it has one or none is known).
        fallback: How the engine's fallback is named in the layer's path.
    """

    name: str
    layer: Any
    variables: tuple[Any, ...]
    rule: Any
    reason: str = ""
    fallback: str = FALLBACK_PATH

    @property
    def path(self) -> str:
        """How the primitives are computed: `rule:<name>` or the fallback."""
        return f"rule:{self.rule.name}" if self.rule else self.fallback

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables)


def unique_name(name: str, used: set[str]) -> str:
    """`name`, or `name_1`, `name_2`, ... : the first not in `used` (then added to it)."""
    candidate, suffix = name, 1
    while candidate in used:
        candidate = f"{name}_{suffix}"
        suffix += 1
    used.add(candidate)
    return candidate
