"""Several training steps in one call of the compiled function (`steps_per_execution`).

Keras runs `steps_per_execution` steps in one `tf.while_loop` and returns the last
step's logs. A tracked model needs every step's rows as well: here each step's
payload is written into `tf.TensorArray`s inside the loop, and the call returns them
stacked (per-step values) or concatenated (per-example rows), so the host fetches
the rows of all the call's steps at once and reports them step by step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree

from keras_gradtrack.engine.schedule import PAYLOAD_KEY

# The payload key of each step's batch size (every step's payload has it).
BATCH_SIZE = "batch_size"


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one call of a multi-step function returns.

    Attributes:
        logs: The last step's logs, as Keras returns them.
        steps: How many steps ran (fewer than asked when the data ran out).
        payload: Per-step values stacked along a new axis 0 (one row per step);
            per-example rows of all steps concatenated along axis 0.
        per_example: The payload keys that hold per-example rows.
    """

    logs: dict[str, Any]
    steps: int
    payload: dict[str, np.ndarray]
    per_example: frozenset[str]

    def step_payloads(self) -> Iterator[dict[str, np.ndarray]]:
        """Each step's payload, in order, as a single step would have returned it."""
        sizes = self.payload[BATCH_SIZE].astype(np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        for step in range(self.steps):
            yield {
                key: value[starts[step] : ends[step]] if key in self.per_example else value[step]
                for key, value in self.payload.items()
            }


def is_per_example(value: tf.Tensor) -> bool:
    """Whether a payload value holds per-example rows: its leading axis is the batch's,
    which a tracked step leaves unknown (per-step values are scalars or `(L,)`)."""
    return value.shape.rank is not None and value.shape.rank > 0 and value.shape[0] is None


def without_optionals(data: Any) -> Any:
    """`data` with each `tf.experimental.Optional` replaced by None (as Keras feeds steps)."""
    return tree.map_structure(
        lambda value: None if isinstance(value, tf.experimental.Optional) else value, data
    )


def multi_step_function(
    step: Callable[[Any], dict[str, Any]], steps: int, jit_compile: bool
) -> Callable[[Any], Execution]:
    """A function of a data iterator that runs up to `steps` calls of `step`.

    Args:
        step: One training step: data -> its logs with the payload under
            `PAYLOAD_KEY` (a flat dict of tensors holding `batch_size`).
        steps: Steps per call (the model's `steps_per_execution`, at least 2).
        jit_compile: Whether each step is compiled with XLA (the loop is not).

    Returns:
        A function that raises `tf.errors.OutOfRangeError` when the iterator
        has no batch left, and otherwise returns the call's `Execution`.
    """
    one_step = tf.function(
        lambda data: step(without_optionals(data)), jit_compile=jit_compile, reduce_retracing=True
    )
    per_example_keys: dict[str, bool] = {}

    def split(outputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tf.Tensor]]:
        logs = dict(outputs)
        payload = logs.pop(PAYLOAD_KEY)
        return logs, payload

    @tf.function(reduce_retracing=True)
    def run(iterator: Any) -> tuple[Any, tf.Tensor, dict[str, tf.Tensor]]:
        # The first step runs outside the loop: its payload's structure sizes the arrays.
        logs, payload = split(one_step(iterator.get_next()))
        per_example_keys.update({key: is_per_example(value) for key, value in payload.items()})
        arrays = {
            key: tf.TensorArray(value.dtype, size=0, dynamic_size=True, infer_shape=False).write(
                0, value
            )
            for key, value in payload.items()
        }

        def more(count: tf.Tensor, logs: Any, arrays: Any, following: Any) -> tf.Tensor:
            return tf.logical_and(count < steps, following.has_value())

        def body(count: tf.Tensor, logs: Any, arrays: Any, following: Any) -> Any:
            logs, payload = split(one_step(following.get_value()))
            arrays = {key: arrays[key].write(count, payload[key]) for key in arrays}
            # Past the last step of the call no batch is taken (it would be lost).
            following = tf.cond(count + 1 < steps, iterator.get_next_as_optional, lambda: following)
            return count + 1, logs, arrays, following

        count, logs, arrays, _ = tf.while_loop(
            more, body, [tf.constant(1), logs, arrays, iterator.get_next_as_optional()]
        )
        gathered = {
            key: array.concat() if per_example_keys[key] else array.stack()
            for key, array in arrays.items()
        }
        return logs, count, gathered

    def function(iterator: Any) -> Execution:
        logs, count, payload = run(iterator)
        return Execution(
            dict(logs),
            int(count),
            {key: np.asarray(value) for key, value in payload.items()},
            frozenset(key for key, rows in per_example_keys.items() if rows),
        )

    return function
