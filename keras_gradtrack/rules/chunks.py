"""Examples a chunk at a time: the chunk sizes, and the one loop over chunks.

Per-example tensors as large as a batch's kernel gradients (or the copies that
build them) are the largest of a tracked step; taken a chunk of examples at a
time, in order, only one chunk's exist at once. The rules' filter gradients and
the engine's chunked materialized layers both loop here, and a layer's calls are cut
to a chunk of their examples here (`chunk_of_calls`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from keras_gradtrack.rules.contract import LayerCall

# A batch of up to this many examples is one chunk (so steps at batch 128 take no loop).
EXAMPLES_PER_CHUNK = 128

# A larger batch goes this many at a time: two layers' chunk temporaries coexist at
# the step's peak, so smaller chunks lower it (docs/performance.md).
LARGE_BATCH_CHUNK = 64

# (start, end) of a chunk -> (its rows, its addends to the running sums).
ChunkFn = Callable[[tf.Tensor, tf.Tensor], tuple[tf.Tensor, Sequence[tf.Tensor]]]


def chunking(batch: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """`(examples per chunk, number of chunks)` for a batch of `batch` examples."""
    size = tf.where(batch <= EXAMPLES_PER_CHUNK, EXAMPLES_PER_CHUNK, LARGE_BATCH_CHUNK)
    return size, (batch + size - 1) // size


def fits_one_chunk(batch_size: int | None) -> bool:
    """Whether a batch whose size the trace knows is one chunk (no loop needed)."""
    return batch_size is not None and batch_size <= EXAMPLES_PER_CHUNK


def chunk_loop(
    batch: tf.Tensor,
    per_chunk: ChunkFn,
    dtype: tf.DType = tf.float32,
    sums: Sequence[tf.Tensor] = (),
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """`per_chunk` over the batch's examples a chunk at a time (`chunking`), in order.

    A `tf.while_loop` of one iteration at a time: as separate ops, the executor would
    run the chunks side by side and hold every chunk's temporaries at once. A
    `tf.cond` between the loop and the whole batch would trace `per_chunk` twice, so a
    batch known only at run time takes the loop even when it fits one chunk.

    Args:
        batch: The number of examples (a scalar tensor).
        per_chunk: `(start, end) -> (rows, addends)`: the chunk's rows (first axis its
            examples) and what it adds to each running sum.
        dtype: The rows' dtype.
        sums: The running sums' initial values.

    Returns:
        Every chunk's rows concatenated, in the examples' order, and the final sums.
    """
    chunk, count = chunking(batch)

    def body(
        index: tf.Tensor, rows: tf.TensorArray, totals: list[tf.Tensor]
    ) -> tuple[tf.Tensor, tf.TensorArray, list[tf.Tensor]]:
        start = index * chunk
        part, addends = per_chunk(start, tf.minimum(start + chunk, batch))
        totals = [total + addend for total, addend in zip(totals, addends)]
        return index + 1, rows.write(index, part), totals

    initial = (tf.constant(0), tf.TensorArray(dtype, size=count, infer_shape=False), list(sums))
    _, rows, totals = tf.while_loop(
        lambda index, *_: index < count, body, initial, parallel_iterations=1
    )
    return rows.concat(), list(totals)


def batch_size_of(tensor: tf.Tensor) -> tf.Tensor:
    """The examples of `tensor` (its first axis) as a scalar tensor, known or not."""
    return tf.shape(tensor)[0]


def chunk_of_calls(
    calls: Sequence[LayerCall], start: tf.Tensor, end: tf.Tensor
) -> tuple[LayerCall, ...]:
    """The calls restricted to examples `start:end`, marked `one_chunk`: every tensor
    they hold of rank 1 or more is sliced along its first axis (`Rule.dot`'s
    condition: a rule with `dot` reads only tensors whose first axis is the batch)."""

    def cut(value: Any) -> Any:
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return value[start:end]
        return value

    def cut_all(structure: Any) -> Any:
        return tf.nest.map_structure(cut, structure)

    return tuple(
        dataclasses.replace(
            call,
            args=cut_all(call.args),
            kwargs=cut_all(dict(call.kwargs)),
            tapped=cut_all(call.tapped),
            saved=cut_all(dict(call.saved)),
            output_grads=cut_all(call.output_grads),
            one_chunk=True,
        )
        for call in calls
    )
