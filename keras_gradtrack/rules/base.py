"""What a rule is: a pure function from one layer's taps to its primitives."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from keras_gradtrack.engine.taps import LayerCall


@dataclasses.dataclass(frozen=True)
class Reference:
    """The reference vector R (the batch gradient G) restricted to each variable.

    `reference(variable)` is R on that variable: float32, dense, the variable's
    shape, in the rules' scale (see `RuleFn`).

    Attributes:
        values: `{id(variable): R restricted to it}`.
        batch_sums: Ids of the variables on which R is exactly the sum of this
            step's per-example gradients as the rules see them (one replica, no
            weight regularizer). There `<g_i, R> = sum_j <g_i, g_j>`, which a rule
            may take from the Gram matrix when that costs less.
    """

    values: Mapping[int, tf.Tensor]
    batch_sums: frozenset[int] = frozenset()

    def __call__(self, variable: Any) -> tf.Tensor:
        return self.values[id(variable)]

    def is_batch_sum(self, variables: Sequence[Any]) -> bool:
        """Whether R is the sum of the per-example gradients on all of `variables`."""
        return all(id(variable) in self.batch_sums for variable in variables)


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
# shared layer); each call's `output_grads[0]` is `a * d l_i / d z_i` per
# example, for one positive scalar `a` the engine divides out afterwards. Every
# rule must therefore be homogeneous in the output gradients: per-example
# gradients and `dot` of degree 1, `sq_norm` and Gram matrices of degree 2
# (true of every formula built from products with the output gradients).
RuleFn = Callable[[Any, Sequence[LayerCall], Reference], LayerPrimitives]

# Optional: (layer, calls) -> (B, B) Gram matrix <g_i^(k), g_j^(k)>. Rules
# without one (and without `per_example`) get the layer's Gram matrix from the
# exact per-layer fallback.
GramFn = Callable[[Any, Sequence[LayerCall]], tf.Tensor]

# Optional: (layer, calls) -> [(variable, (B, ...) per-example gradient)], one
# pair per trainable variable of the layer, each `d l_i / d variable`.
PerExampleFn = Callable[[Any, Sequence[LayerCall]], list[tuple[Any, tf.Tensor]]]

# (layer, calls) -> whether `per_example` is the cheaper form for the calls'
# static shapes. Called after the forward pass, before the backward pass: only
# the shapes of `tapped` and the inputs are known, not `output_grads`.
ShapeTest = Callable[[Any, Sequence[LayerCall]], bool]


def always(layer: Any, calls: Sequence[LayerCall]) -> bool:
    return True


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
        per_example: Optional per-example gradients of the layer's variables.
            When `materializes` holds for a step's shapes, the engine uses them
            instead of `primitives`, and takes the batch gradient of these
            variables as their sum rather than from the backward pass, so the
            per-example gradients replace work the step does anyway.
        materializes: Whether `per_example` is the cheaper form for the calls'
            shapes (only read when `per_example` is set).
    """

    name: str
    primitives: RuleFn
    applies: Callable[[Any], bool]
    split_activation: bool = True
    gram: GramFn | None = None
    per_example: PerExampleFn | None = None
    materializes: ShapeTest = always

    def derives_gradients(self, layer: Any, calls: Sequence[LayerCall]) -> bool:
        """Whether this step takes the layer's gradients from `per_example`."""
        return self.per_example is not None and self.materializes(layer, calls)


def materialized(
    per_example: Sequence[tf.Tensor], references: Sequence[tf.Tensor]
) -> LayerPrimitives:
    """The primitives from per-example gradients `(B, n)` and their references (any shape, n values)."""
    flat_references = [tf.reshape(reference, [-1]) for reference in references]
    return LayerPrimitives(
        sq_norm=tf.add_n([sum_of_squares(g, axis=1) for g in per_example]),
        dot=tf.add_n([tf.linalg.matvec(g, r) for g, r in zip(per_example, flat_references)]),
    )


def primitives_of(per_example: PerExampleFn) -> RuleFn:
    """The rule function computing a layer's primitives from its per-example gradients."""

    def primitives(layer: Any, calls: Sequence[LayerCall], reference: Reference) -> LayerPrimitives:
        pairs = per_example(layer, calls)
        if not pairs:
            raise ValueError(f"Layer {layer.name!r} has no trainable parameter for this rule.")
        return materialized(
            [flat_per_example(grad) for _, grad in pairs],
            [reference(variable) for variable, _ in pairs],
        )

    return primitives


# Whether `sum_of_squares` may use TensorFlow's one-pass EuclideanNorm kernel,
# which XLA cannot compile (XLA fuses square and sum by itself).
_ONE_PASS_NORMS = contextvars.ContextVar("one_pass_norms", default=True)


@contextlib.contextmanager
def compiled_with_xla(jit_compile: bool) -> Iterator[None]:
    """Rules traced inside use only operations XLA compiles when `jit_compile` is true."""
    token = _ONE_PASS_NORMS.set(not jit_compile)
    try:
        yield
    finally:
        _ONE_PASS_NORMS.reset(token)


def sum_of_squares(tensor: tf.Tensor, axis: Any = None) -> tf.Tensor:
    """`sum x^2` over `axis` (every axis by default) in one pass over the tensor
    (`square` then `reduce_sum` writes and reads a tensor as large as the input)."""
    if _ONE_PASS_NORMS.get():
        return tf.square(tf.math.reduce_euclidean_norm(tensor, axis=axis))
    return tf.reduce_sum(tf.square(tensor), axis=axis)


def gram_of(per_example: Sequence[tf.Tensor]) -> tf.Tensor:
    """`(B, B)` `<g_i, g_j>` summed over the given per-example gradients `(B, n)`."""
    return tf.add_n([tf.matmul(g, g, transpose_b=True) for g in per_example])


def flat_per_example(tensor: tf.Tensor) -> tf.Tensor:
    """`(B, ...)` as `(B, n)`, keeping n static when it is known."""
    return reshape_per_example(tensor, [-1])


def gram_is_cheaper(positions: int | None, width_in: int, width_out: int) -> Any:
    """Whether `||X_i^T D_i||^2` costs less as `<X_i X_i^T, D_i D_i^T>` (`P^2 (in + out)`)
    than by materializing `X_i^T D_i` (`P in out`), for `P` positions per example of
    `X_i` (P x in) and `D_i` (P x out). False when P is unknown; a boolean tensor when
    P is a scalar tensor (a size known only at run time)."""
    return positions is not None and positions * (width_in + width_out) < width_in * width_out


# Materializing per-example gradients of at most this many values per example
# is weighed against the direct form; larger ones (B times this in memory) are
# materialized only where the direct form's Gram matrices would cost more.
MATERIALIZE_MAX_VALUES = 2**16

# One pass over a tensor, in multiply-adds of a matrix product of the same
# time on this class of CPU (measured: ~1 ns per element against ~0.06 ns per
# multiply-add), times the passes a materialized gradient takes (sum, norm, dot).
MATERIALIZED_PASS_COST = 16


def materializing_is_cheaper(positions: int | None, width_in: int, width_out: int) -> bool:
    """Whether a layer applied at `positions` per example (`X_i` P x in, `D_i` P x out)
    costs less with its per-example gradients `X_i^T D_i` materialized.

    The direct form adds the Gram norms `P^2 (in + out)` and the dot `X_i R D_i^T`
    (`P in out`) per example to the step; materializing costs `P in out`, but that
    replaces the backward pass' weight gradient, leaving a few passes over the
    `in out` values. True when P is unknown.
    """
    if positions is None or not gram_is_cheaper(positions, width_in, width_out):
        return True
    values = width_in * width_out
    direct = positions * values + positions**2 * (width_in + width_out)
    return values <= MATERIALIZE_MAX_VALUES and direct > MATERIALIZED_PASS_COST * values


def positions_per_example(tensors: Sequence[Any], channels_first: bool = False) -> int | None:
    """Positions per example (every axis but the batch and channel axes), summed over
    the tensors; None if a size is not static."""
    total = 0
    for tensor in tensors:
        shape = tf.convert_to_tensor(tensor).shape
        positions = shape[2:] if channels_first else shape[1:-1]
        if not positions.is_fully_defined():
            return None
        total += math.prod(positions)
    return total


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
