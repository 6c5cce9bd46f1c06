"""Cross-replica plumbing for the tracked step under a `tf.distribute` strategy.

Every statistic uses the global batch gradient (all-reduced across replicas),
and the per-example rows of all replicas are gathered in replica order, so the
log looks exactly as it would on one device. With one replica these are no-ops.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


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
