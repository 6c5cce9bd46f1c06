"""Materialized layers on batches larger than a chunk: per-example gradients built
one chunk of examples at a time and kept only as squared norms and a sum.

A materialized layer's per-example gradients, `(B, n)`, are the largest tensors
of a tracked step at large batches (held as the loop's pieces and again as their
concatenation).
When the layer's rule has `Rule.dot` (its linear map applied to the reference)
and nothing else in the step reads the per-example gradients (no Gram matrix,
targets or sketches), a batch not known to fit one chunk takes them
`chunks.EXAMPLES_PER_CHUNK` at a time in a sequential loop (`chunks.chunk_loop`): each chunk's squared norms
are kept and its gradients added to the batch gradient, then dropped;
`<g_i, R>` comes from `Rule.dot` once R exists, again a chunk at a time. A batch
known only at run time runs the loops once when it fits one chunk (see
`chunks.chunk_loop`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from keras import ops

from keras_gradtrack.engine.plan import TrackedLayer
from keras_gradtrack.rule_math import total
from keras_gradtrack.rules import LayerCall, Reference, chunks
from keras_gradtrack.rules.contract import checked_per_example
from keras_gradtrack.rules.ops import flat_per_example, sum_of_squares

Calls = tuple[LayerCall, ...]


@dataclasses.dataclass(frozen=True)
class Chunked:
    """One materialized layer's per-example results, taken chunk by chunk.

    Attributes:
        sq_norm: `(B,)` `||g_i||^2` over the layer's variables.
        sums: `{id(variable): (n,)}` the sum of the per-example gradients.
    """

    sq_norm: Any
    sums: dict[int, Any]

    def dot(self, tracked: TrackedLayer, calls: Calls, reference: Reference) -> Any:
        """`(B,)` `<g_i, R>` by the rule's `dot`, one chunk of examples at a time (its
        temporaries, such as a convolution's output, are then a chunk's)."""
        assert tracked.rule is not None and tracked.rule.dot is not None
        rule_dot = tracked.rule.dot
        return over_chunks(calls, lambda part: rule_dot(tracked.layer, part, reference))


def takes_chunks(tracked: TrackedLayer, calls: Calls, keeps_per_example: bool) -> bool:
    """Whether a materialized layer's per-example gradients go chunk by chunk in this
    step: its rule has `dot`, nothing else reads them (`keeps_per_example` false),
    not under XLA (which plans the whole step's memory itself), the batch may
    exceed one chunk, and an example's gradient is larger than its input and output
    (chunking layers with wide outputs costs more memory than it saves:
    docs/performance.md).
    """
    rule = tracked.rule
    if rule is None or rule.dot is None or keeps_per_example or calls[0].xla:
        return False
    if chunks.fits_one_chunk(calls[0].tapped[0].shape[0]):
        return False
    return outweighs_its_activations(tracked, calls)


def outweighs_its_activations(tracked: TrackedLayer, calls: Calls) -> bool:
    """Whether an example's gradient of the layer is larger than its input and
    output gradient, which the chunks' second pass (the dot, once R exists) holds
    in its place (true when a size is unknown)."""
    sizes = [s for call in calls for s in (call.inputs.shape[1:], call.tapped[0].shape[1:])]
    if any(None in size for size in sizes):
        return True
    return tracked.num_parameters > sum(math.prod(size) for size in sizes)


def chunked_gradients(
    tracked: TrackedLayer,
    calls: Calls,
    per_example: Callable[[TrackedLayer, Calls], list[Any]],
) -> Chunked:
    """The layer's squared norms and summed gradient, one chunk of examples at a time.

    Args:
        tracked: The layer (its rule has `dot`).
        calls: Its calls with their output gradients.
        per_example: `(tracked, calls) -> [(b, n) per variable]`, the rule's
            per-example gradients of those calls, flat, in the variables' order.
    """

    def per_chunk(start: Any, end: Any) -> tuple[Any, list[Any]]:
        grads = per_example(tracked, chunks.chunk_of_calls(calls, start, end))
        norms = total([sum_of_squares(g, axis=1, xla=calls[0].xla) for g in grads])
        return norms, [ops.sum(g, axis=0) for g in grads]

    initial = [ops.zeros((math.prod(v.shape),)) for v in tracked.variables]
    norms, sums = chunks.chunk_loop(batch_size(calls), per_chunk, sums=initial)
    return Chunked(norms, {id(v): s for v, s in zip(tracked.variables, sums)})


def over_chunks(calls: Calls, per_chunk: Callable[[Calls], Any]) -> Any:
    """`(B,)` `per_chunk` of the calls' examples, a chunk at a time, in order."""

    def rows(start: Any, end: Any) -> tuple[Any, list[Any]]:
        return per_chunk(chunks.chunk_of_calls(calls, start, end)), []

    return chunks.chunk_loop(batch_size(calls), rows)[0]


def batch_size(calls: Calls) -> Any:
    return chunks.batch_size_of(calls[0].output_grad)


def flat_gradients(tracked: TrackedLayer, calls: Calls) -> list[Any]:
    """The rule's per-example gradients of the calls, `(B, n)` per variable in order.

    Raises:
        ValueError: If the rule returns gradients of other variables than the layer's,
            or laid out otherwise than `(B, *variable.shape)`.
        TypeError: If a gradient is not float32.
    """
    rule = tracked.rule
    assert rule is not None and rule.per_example is not None
    pairs = checked_per_example(rule.name, tracked.layer, rule.per_example(tracked.layer, calls))
    grads = {id(variable): flat_per_example(grad) for variable, grad in pairs}
    if set(grads) != {id(v) for v in tracked.variables}:
        raise ValueError(
            f"Rule {rule.name!r} returned per-example gradients for "
            f"{[v.path for v, _ in pairs]} on layer {tracked.layer.name!r}, whose "
            f"trainable variables are {[v.path for v in tracked.variables]}."
        )
    return [grads[id(v)] for v in tracked.variables]
