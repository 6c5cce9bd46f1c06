"""Layer calls whose inputs do not depend on the batch (a learned position table's
`pos_emb(ops.arange(maxlen))`), broadcast to it: what the probed engines share.

Each backend finds such calls by running (or tracing) its forward pass at two batch
sizes (a call whose input keeps its shape does not follow the batch: the batch size
alone cannot tell a sequence of length B from a batch of B), then makes them on their
input broadcast to the batch size (`broadcast_to_batch`), so their outputs carry a row
per example and the rules apply unchanged. Where the broadcast changes the model's
outputs (the table's output reaches the batch through an operation that mixes rows),
the model is refused (`mixing_rows_error`).

Example:

```python
positions = broadcast_to_batch(ops.arange(6), 4)     # (4, 6)
```
"""

from __future__ import annotations

from typing import Any

from keras import ops


def broadcast_to_batch(value: Any, batch_size: int) -> Any:
    """`value` with a batch axis in front: a leading axis of one becomes it (a
    `(1, maxlen)` index), otherwise one is prepended (a `(maxlen,)` index gives
    `(B, maxlen, dim)` outputs, which broadcast against the batch as `(maxlen, dim)` did)."""
    value = ops.convert_to_tensor(value)
    shape = tuple(value.shape)
    if shape and shape[0] == 1:
        return ops.broadcast_to(value, (batch_size, *shape[1:]))
    return ops.broadcast_to(value[None], (batch_size, *shape))


def mixing_rows_error(layer: Any, shape: tuple[int, ...]) -> ValueError:
    """The refusal of a batchless call whose broadcast changes the model's outputs."""
    return ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) is called on values that do "
        "not depend on the batch (the same for every example), so its per-example "
        "gradients are taken where its outputs meet the batch: the tracked step "
        "broadcasts the call to the batch size. Its outputs must then reach the "
        "batch through operations that keep the batch axis first and treat it row "
        "by row (`x + positions`), but with the broadcast the model's outputs "
        "change (a reduction or reshape over the broadcast axis). Combine the "
        "output with the batch by broadcasting instead. Received: an input of "
        f"shape {shape} after the broadcast."
    )
