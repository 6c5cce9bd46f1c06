"""The rule contract: what a rule receives, what it returns, and what it is.

A rule computes one layer's per-example primitives from what one forward and
one backward pass already hold: each call's arguments and the gradient of the
loss at the tensors its tap recorded. This module is all a rule needs to know of
the engine; the engine builds `LayerCall`s, and looks rules up in the registry
(`keras_gradtrack.rules.register_rule`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import keras
from keras import ops

from keras_gradtrack import rule_math


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One call of a tracked layer in the traced step.

    Attributes:
        args: Positional arguments that the layer's `call` received.
        kwargs: Keyword arguments that the layer's `call` received.
        tapped: The tensors whose gradient the engine takes: the pre-activation
            output (one tensor) when the rule splits the activation off, the
            call's float outputs by default, or what the rule's own `tap` chose.
        saved: Extra tensors a rule's own `tap` kept from the forward pass.
        output_grads: Per-example gradients of the loss at `tapped` (same
            structure), times one positive scalar the engine divides out of the
            rule's results; None in the shape tests, which run before the
            backward pass.
        one_chunk: The engine's own loop over chunks of examples cut this call to
            at most `EXAMPLES_PER_CHUNK` examples (`keras_gradtrack.rules.chunks`):
            a rule adds no loop over chunks of its own.
        xla: The step is compiled by XLA (`model.jit_compile`), which has no
            kernel for some operations (`EuclideanNorm`, the grouped and
            depthwise filter gradients) and fuses elementwise work that
            TensorFlow runs op by op: a rule picks its forms for it.
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    tapped: tuple[Any, ...] = ()
    saved: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    output_grads: tuple[Any, ...] | None = None
    one_chunk: bool = False
    xla: bool = False

    @property
    def inputs(self) -> Any:
        """The layer's main input (first positional argument or `inputs=`)."""
        if self.args:
            return self.args[0]
        return self.kwargs["inputs"]

    @property
    def output_grad(self) -> Any:
        """The gradient at the first tapped tensor (the only one for most rules)."""
        if self.output_grads is None:
            raise ValueError("The output gradients of a call exist only after the backward pass.")
        return self.output_grads[0]


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

    values: Mapping[int, Any]
    batch_sums: frozenset[int] = frozenset()

    def __call__(self, variable: Any) -> Any:
        return self.values[id(variable)]

    def is_batch_sum(self, variables: Sequence[Any]) -> bool:
        """Whether R is the sum of the per-example gradients on all of `variables`."""
        return all(id(variable) in self.batch_sums for variable in variables)


@dataclasses.dataclass(frozen=True)
class Projection:
    """The random projections of each variable's gradient sketch.

    A variable's gradient is seen as a matrix `mat(g)` of `rows` (all axes but the
    last, flattened; 1 for a vector) by `cols` (the last axis). Its sketch is
    `rows(variable)^T mat(g) columns(variable)`, `(r_in, r_out)`: a Kronecker-structured
    random projection that a rule can apply to its factors (the layer's inputs
    and output gradients) without building `g`.

    Attributes:
        matrices: `{id(variable): (rows (rows, r_in), columns (cols, r_out))}`, float32.
    """

    matrices: Mapping[int, tuple[Any, Any]]

    def rows(self, variable: Any) -> Any:
        """`(rows, r_in)`: the projection of the variable's row side."""
        return self.matrices[id(variable)][0]

    def columns(self, variable: Any) -> Any:
        """`(cols, r_out)`: the projection of the variable's column side."""
        return self.matrices[id(variable)][1]


class LayerPrimitives(NamedTuple):
    """Per-example primitives of one layer.

    Attributes:
        sq_norm: `(B,)`, `||g_i^(k)||^2` over the layer's trainable variables.
        dot: `(B,)`, `<g_i^(k), R^(k)>`; None in a step that asks for no dots (the
            rule received no `Reference`).
    """

    sq_norm: Any
    dot: Any | None


# (layer, calls, reference) -> LayerPrimitives. `calls` holds every call of the
# layer in this step (more than one for a shared layer); each call's
# `output_grads` are `a * d l_i / d t_i` per example, for one positive scalar `a`
# the engine divides out afterwards. Every rule must therefore be homogeneous in
# the output gradients: per-example gradients and `dot` of degree 1, `sq_norm`
# and Gram matrices of degree 2 (true of every formula built from products with
# the output gradients). The reference is None in a step whose statistics read no
# dots (norms only): the rule then computes no products with it and returns
# `dot=None`.
RuleFn = Callable[[Any, Sequence[LayerCall], "Reference | None"], LayerPrimitives]

# Optional: (layer, calls) -> (B, B) Gram matrix <g_i^(k), g_j^(k)>. Rules
# without one (and without `per_example`) get the layer's Gram matrix from the
# exact per-layer fallback.
GramFn = Callable[[Any, Sequence[LayerCall]], Any]

# Optional: (layer, calls, target_calls) -> (B, T) `<g_i^(k), g'_j^(k)>` between the
# examples of `calls` and those of `target_calls` (other examples through the same
# layer, with their own output gradients). Homogeneous of degree 1 in each side's
# output gradients. Rules without one get it from per-example gradients.
CrossFn = Callable[[Any, Sequence[LayerCall], Sequence[LayerCall]], Any]

# Optional: (layer, calls, projection) -> [(variable, (B, r_in, r_out) sketch)], one
# pair per trainable variable: `projection.rows(v)^T mat(g_i) projection.columns(v)`
# (see `Projection`), from the factors. Rules without one project per-example gradients.
SketchFn = Callable[[Any, Sequence[LayerCall], Projection], list[tuple[Any, Any]]]

# Optional: (layer, calls, reference) -> (B,) `<g_i^(k), R^(k)>` without per-example
# gradients: the layer's own linear map applied to R, paired with the output
# gradients (for a convolution, `<D_i, conv(x_i, R_kernel)> + <sum_p D_i[p], R_bias>`).
# With it, the engine builds a materialized layer's per-example gradients a chunk of
# examples at a time and keeps only their squared norms and sum, when the batch
# exceeds a chunk (`Rule.dot`).
DotFn = Callable[[Any, Sequence[LayerCall], Reference], Any]

# Optional: (layer, calls) -> [(variable, per-example gradient)], one pair per
# trainable variable of the layer, each `d l_i / d variable`, float32, laid out
# `(B, *variable.shape)` (or the same values in another shape, such as `(B, n)`).
# Under mixed precision the layer's inputs are float16 (and the output gradients
# may be): cast both. The engine checks both (`checked_per_example`).
PerExampleFn = Callable[[Any, Sequence[LayerCall]], list[tuple[Any, Any]]]

# (layer, calls) -> whether `per_example` is the cheaper form for the calls'
# static shapes. Called after the forward pass, before the backward pass: only
# the shapes of `tapped` and the inputs are known, not `output_grads`.
ShapeTest = Callable[[Any, Sequence[LayerCall]], bool]


class Tapped(NamedTuple):
    """What a rule's own tap returns for one call.

    Attributes:
        outputs: The call's outputs, as the layer's own call returns them.
        tapped: The tensors whose per-example gradients the rule needs.
        saved: Other forward values the rule needs afterwards.
    """

    outputs: Any
    tapped: tuple[Any, ...]
    saved: Mapping[str, Any] = {}


# Optional: (layer, call, args, kwargs) -> Tapped, run in place of the layer's
# call during a tracked step (`call` is the layer's own, untapped). For layers
# whose gradients live inside their call, such as a recurrent layer's loop.
TapFn = Callable[[Any, Callable[..., Any], tuple[Any, ...], Mapping[str, Any]], Tapped]


def checked_per_example(
    rule: str, layer: Any, pairs: list[tuple[Any, Any]]
) -> list[tuple[Any, Any]]:
    """`pairs` as a rule's `per_example` returned them, checked against the contract:
    each gradient float32 and laid out `(B, *variable.shape)`, or another shape of
    the same n values per example (flat, `(B, n)`).

    Raises:
        TypeError: If a gradient is not float32.
        ValueError: If a gradient's static shape holds other than n values per example.
    """
    for variable, grad in pairs:
        where = f"Rule {rule!r} on layer {layer.name!r}, variable {variable.path!r}"
        dtype = keras.backend.standardize_dtype(grad.dtype)
        if dtype != "float32":
            raise TypeError(
                f"{where}: per-example gradients must be float32 (cast the layer's inputs "
                f"and output gradients first). Received: dtype={dtype}"
            )
        size = math.prod(variable.shape)
        try:
            shape = tuple(grad.shape)
        except ValueError:  # a rank known only at run time (a chunk loop's result)
            continue
        per_example = shape[1:]
        if not shape or (None not in per_example and math.prod(per_example) != size):
            raise ValueError(
                f"{where}: per-example gradients must be laid out (batch, *variable.shape) "
                f"= {(None, *variable.shape)}, or hold its {size} values per example in "
                f"another shape. Received: shape={tuple(grad.shape)}"
            )
    return pairs


def primitives_from(rule: str, per_example: PerExampleFn) -> RuleFn:
    """The rule function computing a layer's primitives from its per-example
    gradients (checked by `checked_per_example`)."""

    def primitives(
        layer: Any, calls: Sequence[LayerCall], reference: Reference | None
    ) -> LayerPrimitives:
        pairs = checked_per_example(rule, layer, per_example(layer, calls))
        if not pairs:
            raise ValueError(f"Layer {layer.name!r} has no trainable parameter for this rule.")
        flat = [(ops.reshape(g, (-1, math.prod(v.shape))), v) for v, g in pairs]
        sq_norm = rule_math.total([ops.sum(ops.square(g), axis=1) for g, _ in flat])
        if reference is None:
            return LayerPrimitives(sq_norm=sq_norm, dot=None)
        dots = [ops.matmul(g, ops.reshape(reference(v), (-1, 1)))[:, 0] for g, v in flat]
        return LayerPrimitives(sq_norm=sq_norm, dot=rule_math.total(dots))

    return primitives


def always(layer: Any, calls: Sequence[LayerCall]) -> bool:
    return True


def covers_every_instance(layer: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the per-example primitives of one layer class are computed.

    Attributes:
        name: Short name shown in `gradient_tracking_summary()`.
        primitives: The rule function.
        applies: Whether the rule covers this layer instance (for example, not
            when LoRA or quantization replaced the kernel).
        split_activation: Whether the tap records the pre-activation output
            (the rule then receives `d l_i / d z_i` before the activation); the
            layer must then apply `self.activation` once to its linear output in
            `call`. None (the default): split where the layer has an
            `activation`, otherwise tap the call's outputs.
        tap: Optional tap of the rule's own, run in place of the layer's call
            (see `TapFn`); `split_activation` is then ignored.
        gram: Optional Gram-matrix function (for `pairwise_cosine`).
        per_example: Optional per-example gradients of the layer's variables.
            When `materializes` holds for a step's shapes, the engine uses them
            instead of `primitives`, and takes the batch gradient of these
            variables as their sum rather than from the backward pass, so the
            per-example gradients replace work the step does anyway.
        materializes: Whether `per_example` is the cheaper form for the calls'
            shapes (only read when `per_example` is set).
        covers_sublayers: Whether the layer's column holds its sublayers'
            trainable variables too, and the rule computes their primitives
            from the layer's own calls (a recurrent layer: its weights belong
            to its cell, but the loop that uses them is the layer's). Read
            from the rule registered for the layer's class, also where the
            rule does not apply to an instance: its column then goes to the
            fallback whole.
        cross: Optional products with other examples' gradients (for influence
            on targets), see `CrossFn`.
        sketch: Optional gradient sketches from the factors, see `SketchFn`.
        dot: Optional `<g_i, R>` through the layer's linear map (see `DotFn`).
            With it, a batch of more than `chunks.EXAMPLES_PER_CHUNK` examples has its
            per-example gradients built one chunk at a time (the engine slices
            every tensor of rank 1 or more the calls hold along its first axis,
            so the layer's calls must hold only tensors whose first axis is the
            batch) and reduced to squared
            norms and the batch gradient as they go: none is held whole.
        kernels: Optional: `(layer, calls) -> str`, which TensorFlow kernels
            `per_example` runs for the calls on this machine (the summary's note
            where it materializes).

    Example:

    ```python
    def scale_per_example(layer, calls):
        # y = x * w (w broadcast over the batch): g_i = sum over positions of x_i * d_i
        grads = []
        for call in calls:
            x = ops.cast(call.inputs, "float32")
            d = ops.cast(call.output_grad, "float32")
            grads.append(ops.sum(x * d, axis=tuple(range(1, len(x.shape) - 1))))
        return [(layer.w, sum(grads))]

    kgt.register_rule(Scale, kgt.rules.Rule.from_per_example("scale", scale_per_example))
    ```
    """

    name: str
    primitives: RuleFn
    applies: Callable[[Any], bool] = covers_every_instance
    split_activation: bool | None = None
    tap: TapFn | None = None
    gram: GramFn | None = None
    per_example: PerExampleFn | None = None
    materializes: ShapeTest = always
    covers_sublayers: bool = False
    cross: CrossFn | None = None
    sketch: SketchFn | None = None
    dot: DotFn | None = None
    kernels: Callable[[Any, Sequence[LayerCall]], str] | None = None

    @classmethod
    def from_per_example(cls, name: str, per_example: PerExampleFn, **options: Any) -> Rule:
        """The rule of a layer whose per-example gradients are cheap to build: its
        primitives, Gram matrix and batch gradient all come from `per_example`.

        Args:
            name: Short name shown in `gradient_tracking_summary()`.
            per_example: `(layer, calls) -> [(variable, (B, *variable.shape) float32)]`,
                one pair per trainable variable of the layer (see `PerExampleFn`).
            **options: Other `Rule` fields (`applies`, `split_activation`, ...).

        Returns:
            The `Rule`.

        Example:

        ```python
        kgt.register_rule(Scale, kgt.rules.Rule.from_per_example("scale", scale_per_example))
        ```
        """
        return cls(name, primitives_from(name, per_example), per_example=per_example, **options)

    def splits_activation(self, layer: Any) -> bool:
        """Whether the tap records `layer`'s pre-activation output (see `split_activation`)."""
        if self.split_activation is None:
            return callable(getattr(layer, "activation", None))
        return self.split_activation

    def derives_gradients(self, layer: Any, calls: Sequence[LayerCall]) -> bool:
        """Whether this step takes the layer's gradients from `per_example`."""
        return self.per_example is not None and self.materializes(layer, calls)
