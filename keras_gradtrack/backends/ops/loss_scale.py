"""Loss scaling on a probed engine: the statistics of the unscaled loss, the optimizer's gradients as Keras gives them.

Keras' JAX `compute_loss_and_updates` and its torch `train_step` scale the loss with
`optimizer.scale_loss(loss)`: the loss
times `s`, a `LossScaleOptimizer`'s dynamic scale (`mixed_float16` wraps the
optimizer in one) or any optimizer's `loss_scale_factor`. Every gradient of the
tracked step's one backward pass (`jax.value_and_grad`, `torch.autograd.grad`: the
variables', the probes', the loss probes') is then `s` times the unscaled loss's. The optimizer receives the
variables' as they are (it unscales them and skips non-finite steps itself, as in
Keras' step); the statistics divide them by `s`, recorded as the TensorFlow engine
records it (`engine/tracking.py`): `scale_loss(1.0)` where the differentiated
function calls `scale_loss`, with the optimizer's variables of that call.

Example:

```python
with recording_loss_scale(model.optimizer) as scales:
    loss, aux = model.compute_loss_and_updates(...)
scale = loss_scale_of(scales)          # s, or None when the loss is not scaled
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from keras import ops

from keras_gradtrack._patching import patched


@contextlib.contextmanager
def recording_loss_scale(optimizer: Any) -> Iterator[list[Any]]:
    """Records, per call of `optimizer.scale_loss` in the block, the scale it applies.

    Args:
        optimizer: The model's optimizer (None: nothing is recorded).

    Yields:
        The list the scales are appended to.
    """
    scales: list[Any] = []
    if optimizer is None:
        yield scales
        return
    original = optimizer.scale_loss

    def recording_scale_loss(loss: Any) -> Any:
        scales.append(original(1.0))
        return original(loss)

    with patched(optimizer, "scale_loss", recording_scale_loss):
        yield scales


def loss_scale_of(scales: Sequence[Any]) -> Any:
    """The step's loss scale `s` (float32) from `recording_loss_scale`'s list; None when
    the loss was not scaled (no call, or an optimizer whose `scale_loss` is the identity).

    Raises:
        ValueError: When the loss was scaled more than once.
    """
    if not scales:
        return None
    if len(scales) > 1:
        raise ValueError(
            "The differentiated function called `optimizer.scale_loss` "
            f"{len(scales)} times, so the gradients' loss scale is not one number. "
            "Expected one call (as Keras' `compute_loss_and_updates` makes)."
        )
    (scale,) = scales
    if isinstance(scale, (int, float)) and scale == 1:
        return None
    return ops.convert_to_tensor(scale, "float32")


def unscaled(values: Sequence[Any], scale: Any) -> list[Any]:
    """`values` divided by the loss scale `s` (float32), or as they are without one."""
    if scale is None:
        return list(values)
    return [ops.cast(value, "float32") / scale for value in values]
