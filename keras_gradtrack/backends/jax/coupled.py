"""BatchNormalization in training on JAX, opted in: the coupled layers' rows in the traced step.

What is coupled, and why, is the same on every backend (`ops/coupled.py`,
`engine/coupled.py`): `g_i = d l_i / d theta` with the other examples held fixed,
through the batch statistics, as on TensorFlow. Here: which variables reach a
BatchNormalization call's input is read from the traced forward pass
(`jax.make_jaxpr`, an over-approximation at worst: a layer counted coupled is still
exact, only slower); the coupled layers' rows are those of the Jacobian of the
per-example losses `l` of the full-batch forward, one `jax.vjp` pulled back along
each example's unit vector, vectorized `batch_normalization_chunk_size` examples at
a time and reduced to `sq_norm` and `dot` inside each chunk (memory: chunk x the
coupled parameters); every other layer keeps its rule (`ops/batch_normalization.py`).

Example:

```python
model.track_batch_normalization = True
model.gradient_tracking_summary()   # conv0 ... coupled (per-example vjp through ...)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
from jax.extend.core import Var

from keras_gradtrack._keras_seam import functional_inputs
from keras_gradtrack.backends.jax.plan import TrackedLayer
from keras_gradtrack.backends.jax.rules import f32
from keras_gradtrack.backends.ops.coupled import (
    COUPLED_NAMES_KEY,
    Coupling,
    mixing_layers,
    recording_mixing_calls,
)
from keras_gradtrack.backends.ops.coupled import (
    coupled_path as shared_coupled_path,
)
from keras_gradtrack.backends.ops.rules import LayerPrimitives
from keras_gradtrack.engine.batch_normalization_tracking import DEFAULT_CHUNK_SIZE


def reaching_inputs(jaxpr: Any) -> set[int]:
    """Positions of the jaxpr's inputs that some of its outputs depend on (an equation's
    outputs depend on all of its inputs: nested jaxprs are not looked into)."""
    depends: dict[Any, frozenset[int]] = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
    for equation in jaxpr.eqns:
        sources = frozenset().union(
            *(depends.get(v, frozenset()) for v in equation.invars if isinstance(v, Var))
        )
        for out in equation.outvars:
            depends[out] = sources
    return set().union(*(depends.get(v, frozenset()) for v in jaxpr.outvars if isinstance(v, Var)))


def coupled_positions(
    model: Any, plan: Sequence[TrackedLayer], forward: Callable[[Any], Any], trainable: Any
) -> tuple[list[int], list[str]]:
    """`(positions, mixing)`: positions in `plan` of the layers that BatchNormalization in
    training couples, and the names of the layers called with the batch's moments.

    `forward(trainable)` runs the step's forward pass (its outputs are not used).
    Both empty unless the model opted in; the coupled names are kept for the summary.
    """
    layers = mixing_layers(model) if getattr(model, "track_batch_normalization", False) else []
    if not layers:
        model.__dict__[COUPLED_NAMES_KEY] = frozenset()
        return [], []
    # The mixing layers whose own gamma and beta are rows too: those without a rule,
    # and those called with a mask (the probes keep a call's keyword arguments from a
    # first trace, so the rule would not see the step's mask).
    rows: set[int] = set()
    mixing: list[str] = []

    def mixing_inputs(trainable: Any) -> list[Any]:
        with recording_mixing_calls(layers) as calls:
            forward(trainable)
        rules = {id(tracked.layer): tracked.rule for tracked in plan}
        rows.update(
            id(layer) for layer, _, masked in calls if masked or rules.get(id(layer)) is None
        )
        mixing.extend(dict.fromkeys(layer.name for layer, _, _ in calls))
        return [inputs for _, inputs, _ in calls]

    specs = [jax.ShapeDtypeStruct(jnp.shape(t), jnp.result_type(t)) for t in trainable]
    reaching = reaching_inputs(jax.make_jaxpr(mixing_inputs)(specs).jaxpr)
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    coupled = [
        index
        for index, tracked in enumerate(plan)
        if id(tracked.layer) in rows or any(position[id(v)] in reaching for v in tracked.variables)
    ]
    model.__dict__[COUPLED_NAMES_KEY] = frozenset(plan[index].name for index in coupled)
    return coupled, mixing


def coupled_path(model: Any, tracked: TrackedLayer) -> str:
    """The summary's path of a layer (`ops.coupled.coupled_path`, traced on JAX)."""
    return shared_coupled_path(model, tracked, functional_coupling)


def functional_coupling(model: Any) -> frozenset[str]:
    """The names of the coupled layers, from an abstract trace of the model on zeros shaped
    as its functional inputs (two examples where the batch size is unknown); empty for a
    model without such inputs, or not opted in."""
    inputs = functional_inputs(model)
    if inputs is None or not getattr(model, "track_batch_normalization", False):
        return frozenset()
    x = keras.tree.map_structure(
        lambda t: jnp.zeros([2 if d is None else d for d in t.shape], t.dtype), inputs
    )
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward(trainable: Any) -> Any:
        return model.stateless_call(trainable, non_trainable, x, training=True)

    plan = model.gradient_tracking_plan()
    coupled, _ = coupled_positions(
        model, plan, forward, [v.value for v in model.trainable_variables]
    )
    return frozenset(plan[index].name for index in coupled)


def step_coupling(
    model: Any,
    plan: Sequence[TrackedLayer],
    forward: Callable[[Any], Any],
    per_example_losses: Callable[[Any], Any],
    trainable: Sequence[Any],
    grads: Sequence[Any],
) -> Coupling:
    """The step's `Coupling`.

    Args:
        model: The model.
        plan: The tracked layers.
        forward: `trainable -> anything`: the step's forward pass, for the mixing
            calls it makes (`coupled_positions`).
        per_example_losses: The step's `(B,)` losses `l` as a function of the
            trainable values (the step's own forward pass, the same random draws).
        trainable: The values of `model.trainable_variables`.
        grads: The batch gradient `G`, per trainable variable.
    """
    coupled, mixing = coupled_positions(model, plan, forward, trainable)
    if not coupled:
        return Coupling(mixing=mixing)
    rows = CoupledRows(model, plan, coupled, per_example_losses, trainable)
    return Coupling(rows.columns(grads), mixing, rows.grams)


class CoupledRows:
    """The coupled layers' per-example gradients: rows of the Jacobian of the per-example
    losses `l` with respect to their variables, one `jax.vjp` pulled back along each
    example's unit vector, `batch_normalization_chunk_size` examples at a time.

    Args:
        model: The model.
        plan: The tracked layers.
        coupled: Positions in `plan` of the coupled layers (`coupled_positions`).
        per_example_losses: The step's `(B,)` losses `l` as a function of the
            trainable values.
        trainable: The values of `model.trainable_variables`.
    """

    def __init__(
        self,
        model: Any,
        plan: Sequence[TrackedLayer],
        coupled: Sequence[int],
        per_example_losses: Callable[[Any], Any],
        trainable: Sequence[Any],
    ) -> None:
        position = {id(v): i for i, v in enumerate(model.trainable_variables)}
        self.coupled = list(coupled)
        self.slots = [[position[id(v)] for v in plan[index].variables] for index in coupled]
        flat_slots = [slot for layer_slots in self.slots for slot in layer_slots]

        def losses_of(values: Sequence[Any]) -> Any:
            current = list(trainable)
            for slot, value in zip(flat_slots, values):
                current[slot] = value
            return f32(per_example_losses(current))

        self.losses, self.pullback = jax.vjp(losses_of, [trainable[slot] for slot in flat_slots])
        self.batch = self.losses.shape[0]
        chunk = int(getattr(model, "batch_normalization_chunk_size", DEFAULT_CHUNK_SIZE))
        self.chunk = min(chunk, self.batch)

    def by_layer(self, gradients: Sequence[Any]) -> list[list[Any]]:
        found = iter(gradients)
        return [[f32(next(found)) for _ in layer_slots] for layer_slots in self.slots]

    def example_gradients(self, index: Any) -> list[list[Any]]:
        """Per coupled layer, example `index`'s gradients of its variables."""
        (gradients,) = self.pullback(jax.nn.one_hot(index, self.batch, dtype=self.losses.dtype))
        return self.by_layer(gradients)

    def columns(self, grads: Sequence[Any]) -> dict[int, tuple[LayerPrimitives, Any]]:
        """`{position in plan: (primitives, ||G^(k)||^2)}`, reduced to `sq_norm` and `dot`
        inside each chunk (memory: chunk x the coupled parameters)."""
        references = [[f32(grads[slot]) for slot in layer_slots] for layer_slots in self.slots]

        def example_columns(index: Any) -> Any:
            columns = []
            for layer_gradients, layer_references in zip(self.example_gradients(index), references):
                columns.append(sum(jnp.sum(g**2) for g in layer_gradients))
                pairs = zip(layer_gradients, layer_references)
                columns.append(sum(jnp.sum(g * r) for g, r in pairs))
            return jnp.stack(columns)

        values = jax.lax.map(example_columns, jnp.arange(self.batch), batch_size=self.chunk)
        (summed,) = self.pullback(jnp.ones_like(self.losses))
        found = {}
        for k, (index, layer_summed) in enumerate(zip(self.coupled, self.by_layer(summed))):
            primitives = LayerPrimitives(
                sq_norm=values[:, 2 * k],
                dot=values[:, 2 * k + 1],
                sum_sq_norm=sum(jnp.sum(g**2) for g in layer_summed),
            )
            found[index] = (primitives, sum(jnp.sum(r**2) for r in references[k]))
        return found

    def grams(self) -> dict[int, Any]:
        """`{position in plan: (B, B) <g_i, g_j>}` of the coupled layers, from all their
        rows at once (memory: B x the coupled parameters), as on TensorFlow."""

        def example_rows(index: Any) -> list[Any]:
            return [
                jnp.concatenate([g.reshape(-1) for g in layer_gradients])
                for layer_gradients in self.example_gradients(index)
            ]

        rows = jax.lax.map(example_rows, jnp.arange(self.batch), batch_size=self.chunk)
        return {index: block @ block.T for index, block in zip(self.coupled, rows)}
