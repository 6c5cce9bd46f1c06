"""Statistics: what is logged per example and per step, built from the primitives.

Every statistic is a function of the step's primitives (see
`StepPrimitives`): per-example, per-layer
squared gradient norms and dot products with the batch gradient, the batch
gradient's per-layer squared norms, the squared norms of the summed
per-example gradients, and the per-example losses. The computation runs inside
the compiled train step; only the statistics' values leave it.

Example:

```python
from keras import ops
import keras_gradtrack as kgt

class MaxLayerNorm(kgt.statistics.Statistic):
    name = "max_layer_grad_norm"
    per_example = True

    def compute(self, primitives):
        return ops.sqrt(ops.max(primitives.sq_norm, axis=1))

logger = kgt.HDF5GradientLogger("run.h5", statistics=["cosine", MaxLayerNorm()])
```
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from keras import ops

from keras_gradtrack.io.schema import RESERVED_NAMES


@dataclasses.dataclass(frozen=True)
class StepPrimitives:
    """Everything a statistic may use, for one step of B examples and L layers.

    All tensors are float32. `g_i` is example i's gradient of its own loss `l_i`
    (regularization excluded), `G` the gradient the optimizer receives
    (unscaled), `S = sum_i g_i`.

    Attributes:
        loss: `(B,)` per-example losses `l_i`, sample weights included.
        sq_norm: `(B, L)` `||g_i^(k)||^2`.
        dot: `(B, L)` `<g_i^(k), G^(k)>`; None when no statistic of the step
            reads it (`Statistic.needs_dot`).
        reference_sq_norm: `(L,)` `||G^(k)||^2`.
        sum_sq_norm: `(L,)` `||S^(k)||^2`.
        batch_size: scalar, B as float32.
        gram: `(B, B)` `<g_i, g_j>`, only when a statistic asks for it
            (`Statistic.needs_gram`), else None.
        input_sq_norm: `(B,)` `‖d l_i / d x_i‖^2` over the float inputs, only
            when a statistic asks for it (`Statistic.needs_input_gradients`).

    The derived values (`grad_sq_norm`, `grad_norm`, `reference_norm`, `cosine`) are
    computed once per step, however many statistics read them.
    """

    loss: Any
    sq_norm: Any
    dot: Any
    reference_sq_norm: Any
    sum_sq_norm: Any
    batch_size: Any
    gram: Any = None
    input_sq_norm: Any = None

    @functools.cached_property
    def grad_sq_norm(self) -> Any:
        """`(B,)` `||g_i||^2` over all layers."""
        return ops.sum(self.sq_norm, axis=1)

    @functools.cached_property
    def grad_norm(self) -> Any:
        """`(B,)` `||g_i||`."""
        return ops.sqrt(self.grad_sq_norm)

    @functools.cached_property
    def reference_norm(self) -> Any:
        """Scalar `||G||`."""
        return ops.sqrt(ops.sum(self.reference_sq_norm))

    @functools.cached_property
    def cosine(self) -> Any:
        """`(B,)` `cos(g_i, G)`; NaN where a norm is 0."""
        assert self.dot is not None, "a statistic that reads dots sets needs_dot"
        return ops.sum(self.dot, axis=1) / (self.grad_norm * self.reference_norm)


class Statistic:
    """Base class of all statistics.

    Subclasses set `name`, `per_example` and `per_layer`, and implement
    `compute`. A per-example statistic returns `(B,)` (or `(B, L)` when
    `per_layer`); a per-step statistic returns a scalar (or `(L,)`).

    Attributes:
        name: The dataset name in the log (`/per_example/<name>` or
            `/per_step/<name>`).
        per_example: True for one value per example, False for one per step.
        per_layer: True when the value has one column per tracked layer.
        needs_gram: True when `compute` reads `primitives.gram` (the `(B, B)`
            Gram matrix of the per-example gradients, computed only then).
        needs_input_gradients: True when `compute` reads
            `primitives.input_sq_norm` (taken in the same backward pass, only then).
        needs_dot: True when `compute` reads `primitives.dot` (the products with the
            batch gradient). A step whose statistics all set it False computes no
            products with the batch gradient, and its `primitives.dot` is None.
    """

    name: str = ""
    per_example: bool = True
    per_layer: bool = False
    needs_gram: bool = False
    needs_input_gradients: bool = False
    needs_dot: bool = True

    def compute(self, primitives: StepPrimitives) -> Any:
        """Computes the statistic inside the compiled train step.

        Args:
            primitives: The step's `StepPrimitives`.

        Returns:
            A float32 tensor of shape `(B,)`, `(B, L)`, `()` or `(L,)`.
        """
        raise NotImplementedError

    @property
    def kind(self) -> str:
        """`"per_example"` or `"per_step"`: the group the statistic is written to."""
        return "per_example" if self.per_example else "per_step"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"


class Loss(Statistic):
    """`l_i`: example i's loss, with its sample weight, before reduction."""

    name = "loss"
    needs_dot = False

    def compute(self, primitives: StepPrimitives) -> Any:
        return primitives.loss


class GradNorm(Statistic):
    """`||g_i||`: the norm of example i's gradient over all trainable variables."""

    name = "grad_norm"
    needs_dot = False

    def compute(self, primitives: StepPrimitives) -> Any:
        return primitives.grad_norm


class Cosine(Statistic):
    """`<g_i, G> / (||g_i|| ||G||)`: agreement of example i with the batch gradient."""

    name = "cosine"

    def compute(self, primitives: StepPrimitives) -> Any:
        return primitives.cosine


class LayerGradNorm(Statistic):
    """`||g_i^(k)||` per tracked layer k."""

    name = "layer_grad_norm"
    needs_dot = False
    per_layer = True

    def compute(self, primitives: StepPrimitives) -> Any:
        return ops.sqrt(primitives.sq_norm)


class LayerCosine(Statistic):
    """`cos(g_i^(k), G^(k))` per tracked layer k; NaN where a norm is 0."""

    name = "layer_cosine"
    per_layer = True

    def compute(self, primitives: StepPrimitives) -> Any:
        norms = ops.sqrt(primitives.sq_norm) * ops.sqrt(primitives.reference_sq_norm)[None, :]
        return primitives.dot / norms


class BatchGradNorm(Statistic):
    """`||G||`: the norm of the gradient the optimizer receives."""

    name = "batch_grad_norm"
    needs_dot = False
    per_example = False

    def compute(self, primitives: StepPrimitives) -> Any:
        return primitives.reference_norm


class GradientDiversity(Statistic):
    """`sum_i ||g_i||^2 / ||sum_i g_i||^2` (Yin et al., 2018)."""

    name = "gradient_diversity"
    needs_dot = False
    per_example = False

    def compute(self, primitives: StepPrimitives) -> Any:
        return ops.sum(primitives.grad_sq_norm) / ops.sum(primitives.sum_sq_norm)


class NoiseScale(Statistic):
    """`B_simple = tr(Sigma) / ||mean_i g_i||^2` (McCandlish et al., 2018).

    `tr(Sigma) = (1/(B-1)) sum_i ||g_i - mean g||^2`; NaN for a batch of one.
    """

    name = "noise_scale"
    needs_dot = False
    per_example = False

    def compute(self, primitives: StepPrimitives) -> Any:
        batch = primitives.batch_size
        mean_sq_norm = ops.sum(primitives.sum_sq_norm) / ops.square(batch)
        total_sq_norm = ops.sum(primitives.grad_sq_norm)
        trace = (total_sq_norm - batch * mean_sq_norm) / (batch - 1.0)
        # One example has no spread: NaN by definition, whatever the rounding of 0/0.
        return ops.where(batch > 1.0, trace / mean_sq_norm, float("nan"))


class MeanCosine(Statistic):
    """The step's mean of the per-example cosines (NaN entries ignored)."""

    name = "mean_cosine"
    per_example = False

    def compute(self, primitives: StepPrimitives) -> Any:
        cosine = primitives.cosine
        finite = ops.isfinite(cosine)
        return ops.sum(ops.where(finite, cosine, 0.0)) / ops.sum(ops.cast(finite, "float32"))


class FracNegativeCosine(Statistic):
    """The fraction of the step's examples whose gradient opposes the batch's."""

    name = "frac_negative_cosine"
    per_example = False

    def compute(self, primitives: StepPrimitives) -> Any:
        return ops.mean(ops.cast(primitives.cosine < 0.0, "float32"))


class PairwiseCosine(Statistic):
    """`(B, B)` `cos(g_i, g_j)` for every pair of the step's examples; opt-in.

    Costs a Gram matrix per layer (closed form for Dense, the per-layer
    Jacobian for other layers), so it is never on by default. It is returned
    by `model.gradient_statistics(..., statistics=["pairwise_cosine"])`; the
    HDF5 logger does not write it (its width changes with the batch size).
    """

    name = "pairwise_cosine"
    needs_dot = False
    per_layer = False
    needs_gram = True

    def compute(self, primitives: StepPrimitives) -> Any:
        assert primitives.gram is not None
        norms = primitives.grad_norm
        return primitives.gram / (norms[:, None] * norms[None, :])


class InputGradNorm(Statistic):
    """`‖d l_i / d x_i‖`: the norm of example i's loss gradient at its own (float) inputs.

    Taken in the same backward pass as the weight gradients (each example's
    input affects only its own loss); opt-in. Models whose inputs are all
    integers (token ids) have no input gradient and are refused.
    """

    name = "input_grad_norm"
    needs_dot = False
    needs_input_gradients = True

    def compute(self, primitives: StepPrimitives) -> Any:
        assert primitives.input_sq_norm is not None
        return ops.sqrt(primitives.input_sq_norm)


# Computed only on request, by name: not part of the defaults.
OPT_IN: dict[str, type[Statistic]] = {
    PairwiseCosine.name: PairwiseCosine,
    InputGradNorm.name: InputGradNorm,
}

BUILTINS: dict[str, type[Statistic]] = {
    cls.name: cls
    for cls in (
        Loss,
        GradNorm,
        Cosine,
        LayerGradNorm,
        LayerCosine,
        BatchGradNorm,
        GradientDiversity,
        NoiseScale,
        MeanCosine,
        FracNegativeCosine,
    )
}

DEFAULT_STATISTICS: tuple[str, ...] = tuple(BUILTINS)


def get(identifier: str | Statistic) -> Statistic:
    """Returns the statistic named `identifier`, or `identifier` itself if it is one.

    Raises:
        ValueError: For an unknown name, listing the valid ones, and for a
            `Statistic` whose name is empty or one the log reserves for its own
            columns (`step`, `epoch`, `example_id`, `batch_size`, `learning_rate`).
    """
    if isinstance(identifier, Statistic):
        if not identifier.name:
            raise ValueError(f"A Statistic needs a non-empty `name`. Received: {identifier!r}")
        if identifier.name in RESERVED_NAMES:
            raise ValueError(
                f"Expected a statistic name other than the log's own columns "
                f"{list(RESERVED_NAMES)}. Received: {identifier!r}"
            )
        return identifier
    if isinstance(identifier, str) and identifier in {**BUILTINS, **OPT_IN}:
        return {**BUILTINS, **OPT_IN}[identifier]()
    raise ValueError(
        f"Unknown statistic. Expected one of {sorted({**BUILTINS, **OPT_IN})} or a "
        f"keras_gradtrack.statistics.Statistic instance. Received: {identifier!r}"
    )


def resolve(identifiers: Iterable[str | Statistic] | None) -> list[Statistic]:
    """Resolves a list of names / objects (None: the defaults), refusing duplicates."""
    if isinstance(identifiers, (str, Statistic)):
        raise TypeError(
            f"`statistics` must be a list of names or Statistic objects. Received: {identifiers!r}"
        )
    requested: Sequence[str | Statistic] = (
        DEFAULT_STATISTICS if identifiers is None else list(identifiers)
    )
    resolved = [get(identifier) for identifier in requested]
    names = [statistic.name for statistic in resolved]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Each statistic may be requested once. Received duplicates: {duplicates}")
    return resolved


__all__ = [
    "BUILTINS",
    "DEFAULT_STATISTICS",
    "BatchGradNorm",
    "Cosine",
    "FracNegativeCosine",
    "GradNorm",
    "GradientDiversity",
    "InputGradNorm",
    "LayerCosine",
    "LayerGradNorm",
    "Loss",
    "MeanCosine",
    "NoiseScale",
    "OPT_IN",
    "PairwiseCosine",
    "Statistic",
    "StepPrimitives",
    "get",
    "resolve",
]
