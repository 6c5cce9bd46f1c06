"""What a rule is: a pure function from one layer's taps to its primitives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from keras_gradtrack.engine.taps import LayerCall

# Maps one of the layer's variables to the reference vector R restricted to it
# (the batch gradient G, float32, dense, same shape as the variable).
ReferenceFn = Callable[[Any], tf.Tensor]


class LayerPrimitives(NamedTuple):
    """Per-example primitives of one layer.

    Attributes:
        sq_norm: `(B,)`, `||g_i^(k)||^2` over the layer's trainable variables.
        dot: `(B,)`, `<g_i^(k), R^(k)>`.
    """

    sq_norm: tf.Tensor
    dot: tf.Tensor


# A rule's one fixed signature: (layer, calls, reference) -> LayerPrimitives.
# `calls` holds every call of the layer in this step (more than one for a
# shared layer); each call's `output_grads[0]` is `d l_i / d z_i` per example.
RuleFn = Callable[[Any, Sequence[LayerCall], ReferenceFn], LayerPrimitives]

# Optional: (layer, calls) -> (B, B) Gram matrix <g_i^(k), g_j^(k)>. Rules
# without one get the layer's Gram matrix from the exact per-layer fallback.
GramFn = Callable[[Any, Sequence[LayerCall]], tf.Tensor]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule registered for a layer class.

    Attributes:
        name: Short name shown in `gradient_tracking_summary()`.
        primitives: The rule function.
        applies: Whether the rule covers this layer instance (for example, not
            when LoRA or quantization replaced the kernel).
        split_activation: Whether the tap records the pre-activation output
            (the rule then receives `d l_i / d z_i` before the activation).
        gram: Optional Gram-matrix function (for `pairwise_cosine`).
    """

    name: str
    primitives: RuleFn
    applies: Callable[[Any], bool]
    split_activation: bool = True
    gram: GramFn | None = None


def reshape_per_example(tensor: tf.Tensor, dims: Sequence[int]) -> tf.Tensor:
    """Reshapes to `(B, *dims)` keeping every static size static.

    At most one of `dims` is -1. `fit` usually traces with an unknown batch
    size; a plain `tf.reshape(t, [B, -1, d])` would then lose the static size
    of the -1 axis, and the rules choose their cheapest form from static sizes.
    """
    dims = list(dims)
    known = tensor.shape[1:]
    if -1 in dims and known.is_fully_defined():
        others = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(known) // others
    return tf.reshape(tensor, [tf.shape(tensor)[0], *dims])
