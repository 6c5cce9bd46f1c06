"""Tracking under `keras.distribution` on JAX: `DataParallel` and `ModelParallel`, in one process or several.

Under `keras.distribution` Keras' JAX trainer shards each batch along its first axis
across the devices (`DataParallel`; `ModelParallel` along the mesh's batch axis, its
weights as its layout map says) and runs the jitted step on global arrays, so XLA's
partitioner gives every value its global meaning: the probes' gradients are the rows
of the whole batch, the batch gradient `G` is all-reduced, the rules' products of
sharded weights and activations are partitioned like the forward pass, and the
payload vector and the example ids are global arrays that one `np.asarray` gathers.
Nothing here adds a collective to the step. Over several processes
(`keras.distribution.initialize`), each process gives its own rows of every global
batch, as in Keras; the step's payload and the example ids are global arrays that
every process gathers (`on_host`, one `process_allgather` after each tracked step),
and the first process writes the logs (`writes_log`). A `Distribution` class of one's
own is refused before any weight changes.

Example:

```python
refuse_untracked_distribution()          # in the first tracked step, before it runs
jax.jit(step, donate_argnums=0, out_shardings=step_out_shardings(model))
```
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_gradtrack._keras_seam import state_sharding_spec

TRACKED = (keras.distribution.DataParallel, keras.distribution.ModelParallel)


def refuse_untracked_distribution() -> None:
    """Raises `NotImplementedError` under a `keras.distribution` tracking cannot follow."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    if not isinstance(distribution, TRACKED):
        raise NotImplementedError(
            f"Tracking under {type(distribution).__name__} is not available on the JAX "
            "backend: tracked are keras.distribution.DataParallel and ModelParallel. "
            f"Received: distribution={distribution!r}"
        )


def step_out_shardings(model: keras.Model) -> Any:
    """The `out_shardings` Keras' trainer gives its jitted train step: none without a
    distribution, else the state's shardings as they are now (read while the
    variables hold their values, before `fit` moves them into the step's state)."""
    if keras.distribution.distribution() is None:
        return None
    return (None, state_sharding_spec(model))


def on_host(value: Any) -> np.ndarray:
    """`value` as a numpy array; a global array that spans other processes' devices
    gathered from every process (a collective: every process calls it, in the same
    order)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def writes_log() -> bool:
    """Whether this process writes the logs: the first of a run over several processes."""
    return jax.process_index() == 0


def global_batch(data: Any) -> Any:
    """Under a `keras.distribution` over several processes, each process's `data` as its
    rows of one global batch, in the order of the processes (as Keras' trainer places
    `fit`'s batches); otherwise `data` as it is."""
    distribution = keras.distribution.distribution()
    if distribution is None or jax.process_count() == 1:
        return data

    def placed(value: Any) -> Any:
        if value is None:
            return None
        layout = distribution.get_data_layout(np.shape(value)).backend_layout
        return jax.make_array_from_process_local_data(layout, np.asarray(value))

    return keras.tree.map_structure(placed, data)
