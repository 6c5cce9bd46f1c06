"""Per-output-feature weight gradients on the probed engines (JAX, PyTorch), for
`OutputGradientLogger`: what `autodiff.OutputGradients` computes on TensorFlow.

For each feature `f` along `axis` of `y = model(x)`, `d sum(y[..., f, ...]) / d W` for
the given variables, `chunk_size` features at a time, each feature's backward pass
after the other (memory grows with the chunk, not with the number of features). A
backend gives `chunk(x, features) -> (grads, num_features)`: one forward pass and a
backward pass per feature, a feature index past the last one an all-zero cotangent.

Example:

```python
gradients = OutputGradients(chunk, chunk_size=4)
for features, grads in gradients(x):   # numpy: grads[j] (len(features),) + shape
    ...
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from keras_gradtrack._keras_seam import flatten_layers, own_trainable_variables

Chunk = Callable[[Any, np.ndarray], tuple[Sequence[Any], int]]


class OutputGradients:
    """A backend's per-feature gradients streamed chunk by chunk, as numpy arrays
    (`autodiff.OutputGradients`' interface)."""

    def __init__(self, chunk: Chunk, chunk_size: int) -> None:
        self._chunk = chunk
        self._chunk_size = int(chunk_size)

    def __call__(self, x: Any) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
        start, num_features = 0, self._chunk_size  # known once the first chunk has run
        while start < num_features:
            features = np.arange(start, start + self._chunk_size)
            grads, num_features = self._chunk(x, features)
            valid = min(self._chunk_size, int(num_features) - start)
            yield features[:valid], [keras.ops.convert_to_numpy(g)[:valid] for g in grads]
            start += self._chunk_size


def feature_cotangent(shape: Sequence[int], axis: int, feature: Any, ops: Any) -> Any:
    """Ones on `feature` along `axis` of an output of `shape`, zeros elsewhere (all
    zeros for a feature past the last): the cotangent of `sum(y[..., feature, ...])`.
    `ops` the backend's array module (`jax.numpy`, or `keras.ops`)."""
    selected = ops.arange(shape[axis]) == feature
    broadcast = [1] * len(shape)
    broadcast[axis] = shape[axis]
    return ops.broadcast_to(ops.reshape(selected, broadcast), tuple(shape))


def output_columns(model: Any) -> list[tuple[Any, list[Any]]]:
    """`(layer, its variables)` per column: a tracking model's plan (as the per-example
    columns), else every layer with trainable variables of its own, in the order of
    `model.trainable_variables`."""
    if hasattr(model, "gradient_tracking_plan"):
        return [(t.layer, list(t.variables)) for t in model.gradient_tracking_plan()]
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    groups = []
    for layer in flatten_layers(model, include_self=False):
        own = [v for v in own_trainable_variables(layer) if id(v) in position]
        if own:
            groups.append((layer, sorted(own, key=lambda v: position[id(v)])))
    return sorted(groups, key=lambda group: position[id(group[1][0])])
