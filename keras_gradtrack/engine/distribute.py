"""Cross-replica plumbing for the tracked step under a `tf.distribute` strategy.

Every statistic uses the global batch gradient (all-reduced across replicas),
and the per-example rows of all replicas are gathered in replica order, so the
log looks exactly as it would on one device. With one replica these are no-ops.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras import tree

from keras_gradtrack._keras_seam import collective_all_reduce_multi_worker


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


# The two halves of an int64 output, each small enough for an exact mean.
INT64_HIGH = "int64_high_32_bits"
INT64_LOW = "int64_low_32_bits"


def protect_from_replica_mean(outputs: Any) -> Any:
    """Adds a leading axis of 1 to every output of a step run on several replicas.

    Keras reduces a step's outputs with a mean over replicas; under
    MultiWorkerMirroredStrategy that mean runs along axis 0 of each value, which
    fails for scalars (a known Keras 3 issue, tensorflow/tensorflow#72388) and
    would average the per-example rows. Over a new leading axis the mean is
    right for scalars and leaves the gathered rows (identical on every
    replica) unchanged.

    An int64 value (the example ids) is split into its high and low 32 bits: the
    mean of identical int64 values overflows from 2**62 up (MirroredStrategy sums
    them first) and is rounded from 2**53 up (MultiWorkerMirroredStrategy
    averages in float64); that of identical 32-bit halves is exact either way.
    """
    if num_replicas() == 1:
        return outputs

    def protect(value: tf.Tensor) -> Any:
        value = tf.expand_dims(value, 0)
        if value.dtype != tf.int64:
            return value
        return {
            INT64_HIGH: tf.bitwise.right_shift(value, 32),  # arithmetic: keeps the sign
            INT64_LOW: tf.bitwise.bitwise_and(value, 0xFFFFFFFF),
        }

    return tree.map_structure(protect, outputs)


def unprotect(outputs: Any, strategy: tf.distribute.Strategy) -> Any:
    """Undoes `protect_from_replica_mean` on the reduced outputs.

    A multi-worker strategy's mean along axis 0 has already consumed the axis.
    """
    if strategy.num_replicas_in_sync == 1:
        return outputs
    if not collective_all_reduce_multi_worker(strategy):
        outputs = tree.map_structure(lambda value: value[0], outputs)
    return _joined_int64(outputs)


def _joined_int64(outputs: Any) -> Any:
    if not isinstance(outputs, dict):
        return outputs
    if set(outputs) != {INT64_HIGH, INT64_LOW}:
        return {key: _joined_int64(value) for key, value in outputs.items()}

    def as_int64(half: tf.Tensor) -> tf.Tensor:
        # A multi-worker mean returns the halves as float64: exact, being below 2**53.
        return tf.cast(tf.round(half) if half.dtype.is_floating else half, tf.int64)

    # high * 2**32 stays within int64 (high < 2**31), and adding low < 2**32 too.
    return as_int64(outputs[INT64_HIGH]) * (1 << 32) + as_int64(outputs[INT64_LOW])


def first_replica(data: Any, strategy: Any) -> Any:
    """`data` with each distributed value replaced by its first replica's (shapes per replica)."""
    return tree.map_structure(
        lambda value: (
            strategy.experimental_local_results(value)[0]
            if isinstance(value, tf.distribute.DistributedValues)
            else value
        ),
        data,
    )
