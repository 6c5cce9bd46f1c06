"""What the shared step reads from a probed engine's backend, as one value.

The rest of the protocol (how the probes are differentiated, the trainer glue, the
draws) stays in each backend's step; docs/architecture.md lists all of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from keras_gradtrack.backends.ops.rules import PerExample, ProbedCall

# `(model, plan, targets, trainable, non_trainable, target_losses) -> per layer of the
# plan, its calls on the targets with their losses' output gradients`.
TargetCalls = Callable[..., list[list[ProbedCall]]]


@dataclasses.dataclass(frozen=True)
class Backend:
    """A probed engine's parts of the protocol that the shared step calls.

    Attributes:
        fallback: The exact per-layer fallback (`PerExample`): per-example gradients of
            a layer without a rule, from its local VJP.
        target_calls: The pass on an attribution request's targets (`TargetCalls`).
    """

    fallback: PerExample
    target_calls: TargetCalls
