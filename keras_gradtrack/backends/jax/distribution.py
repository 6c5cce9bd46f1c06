"""Tracking under `keras.distribution` on JAX: `DataParallel` and `ModelParallel`, in one process.

Under `keras.distribution` Keras' JAX trainer shards each batch along its first axis
across the devices (`DataParallel`; `ModelParallel` along the mesh's batch axis, its
weights as its layout map says) and runs the jitted step on global arrays, so XLA's
partitioner gives every value its global meaning: the probes' gradients are the rows
of the whole batch, the batch gradient `G` is all-reduced, the rules' products of
sharded weights and activations are partitioned like the forward pass, and the
payload vector and the example ids are global arrays that one `np.asarray` gathers.
Nothing here adds a collective. A run over several processes (where a process cannot
read the other processes' rows), or a `Distribution` class of one's own, is refused
before any weight changes.

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
    if jax.process_count() > 1:
        raise NotImplementedError(
            "Tracking under keras.distribution runs in one process (its devices local "
            "to it): with several processes each reads only its own rows "
            f"of the global batch. Received: jax.process_count() == {jax.process_count()}"
        )


def step_out_shardings(model: keras.Model) -> Any:
    """The `out_shardings` Keras' trainer gives its jitted train step: none without a
    distribution, else the state's shardings as they are now (read while the
    variables hold their values, before `fit` moves them into the step's state)."""
    if keras.distribution.distribution() is None:
        return None
    return (None, state_sharding_spec(model))
