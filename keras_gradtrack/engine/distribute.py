"""Cross-replica plumbing for the tracked step under a `tf.distribute` strategy.

Every statistic uses the global batch gradient (all-reduced across replicas),
and the per-example rows of all replicas are gathered in replica order, so the
log looks exactly as it would on one device. With one replica these are no-ops.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras import tree
from keras.src.backend.tensorflow.trainer import _collective_all_reduce_multi_worker


def num_replicas() -> int:
    """Replicas in sync in the current strategy (1 without one)."""
    return int(tf.distribute.get_strategy().num_replicas_in_sync)


def all_reduce_sum(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """Sums each tensor across replicas (inside the replica function)."""
    if num_replicas() == 1:
        return tensors
    return list(tf.distribute.get_replica_context().all_reduce("sum", tensors))


def all_gather_rows(rows: dict[str, Any]) -> dict[str, Any]:
    """Concatenates each replica's per-example rows along axis 0, in replica order."""
    if num_replicas() == 1:
        return rows
    context = tf.distribute.get_replica_context()
    return {name: context.all_gather(value, axis=0) for name, value in rows.items()}


def protect_from_replica_mean(outputs: Any) -> Any:
    """Adds a leading axis of 1 to every output of a step run on several replicas.

    Keras reduces a step's outputs with a mean over replicas; under
    MultiWorkerMirroredStrategy that mean runs along axis 0 of each value, which
    fails for scalars (a known Keras 3 issue, tensorflow/tensorflow#72388) and
    would average the per-example rows. Over a new leading axis the mean is
    right for scalars and leaves the gathered rows (identical on every
    replica) unchanged.
    """
    if num_replicas() == 1:
        return outputs
    return tree.map_structure(lambda value: tf.expand_dims(value, 0), outputs)


def unprotect(outputs: Any, strategy: tf.distribute.Strategy) -> Any:
    """Removes the axis added by `protect_from_replica_mean`.

    A multi-worker strategy's mean along axis 0 has already consumed it.
    """
    if strategy.num_replicas_in_sync == 1 or _collective_all_reduce_multi_worker(strategy):
        return outputs
    return tree.map_structure(lambda value: value[0], outputs)
