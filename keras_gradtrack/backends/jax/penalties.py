"""Weight penalties in a differentiated function of one's own: with which weight its loss holds each.

A private step adds the gradient of the weight penalties (`variable.regularizer`)
unclipped and without noise. Keras' own step adds each penalty once to the loss; a
function of one's own (a `train_step` or `compute_loss` of the model's own) may add
them scaled, or not at all. As the TensorFlow engine reads it from its backward pass,
a zero probe is added to each penalty while the function runs (`probing_penalties`):
its gradient is the weight `dL/dp_k` with which the loss holds penalty `k` (0 for
one it leaves out; the sum for one computed twice), and the penalties' part of the
gradient is `sum_k (dL/dp_k) d p_k / d theta` (`private_step.penalty_gradients`).

Example:

```python
with probing_penalties(model, zeros):
    loss = fun(trainable, ...)      # Keras computes `regularizer(v) + zeros[k]`
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


def regularized_variables(model: Any) -> list[Any]:
    """The model's trainable variables with a weight penalty, in their order."""
    return [v for v in model.trainable_variables if getattr(v, "regularizer", None) is not None]


@contextlib.contextmanager
def probing_penalties(model: Any, probes: Sequence[Any] | None) -> Iterator[None]:
    """While in the block, penalty `k` (of `regularized_variables`) is its
    regularizer's value plus `probes[k]` (a float32 scalar); None adds nothing."""
    regularized = regularized_variables(model) if probes is not None else []
    originals = [variable.regularizer for variable in regularized]

    def probed(regularizer: Any, probe: Any) -> Any:
        def penalty(value: Any) -> Any:
            found = regularizer(value)
            return found + probe.astype(found.dtype)

        return penalty

    try:
        for variable, regularizer, probe in zip(regularized, originals, probes or ()):
            variable.regularizer = probed(regularizer, probe)
        yield
    finally:
        for variable, regularizer in zip(regularized, originals):
            variable.regularizer = regularizer
