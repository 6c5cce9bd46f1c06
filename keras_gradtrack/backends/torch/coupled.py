"""BatchNormalization in training on PyTorch, opted in: the coupled layers' rows from the step's graph.

What is coupled, and why, is the same on every backend (`ops/coupled.py`,
`engine/coupled.py`). Here: which variables reach a BatchNormalization call's input
is read from the step's autograd graph (`torch.autograd.grad` of those inputs' sum
gives no gradient, `None`, to a variable without a path to them); the coupled
layers' rows, `d l_i / d theta` with the other examples held fixed, are pulled back
from the step's own graph (the same dropout masks) by
`torch.autograd.grad(..., is_grads_batched=True)` along each example's unit vector,
`batch_normalization_chunk_size` examples at a time, and reduced to `sq_norm` and
`dot` inside each chunk (memory: chunk x the coupled parameters).

Example:

```python
coupled = coupled_positions(model, plan, forward.mixing)   # [0, 1, 2]: conv0, bn0, conv1
coupling = step_coupling(model, plan, coupled, forward.mixing, losses, grads)
```
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras
import torch
from keras import ops

from keras_gradtrack._keras_seam import functional_inputs
from keras_gradtrack.backends.ops.coupled import (
    COUPLED_NAMES_KEY,
    Coupling,
    coupled_path,
    mixing_layers,
    recording_mixing_calls,
)
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.rules import LayerPrimitives
from keras_gradtrack.engine.batch_normalization_tracking import DEFAULT_CHUNK_SIZE


def opted_in_mixing_layers(model: Any) -> list[Any]:
    """The layers whose calls in training couple the examples, where the model opts in."""
    return mixing_layers(model) if getattr(model, "track_batch_normalization", False) else []


def coupled_positions(
    model: Any, plan: Sequence[TrackedLayer], calls: Sequence[tuple[Any, Any, bool]]
) -> list[int]:
    """Positions in `plan` of the layers that the recorded BatchNormalization `calls`
    (`(layer, input, masked)`, of this step's graph) couple."""
    if not calls:
        return []
    rules = {id(tracked.layer): tracked.rule for tracked in plan}
    rows = {id(layer) for layer, _, masked in calls if masked or rules.get(id(layer)) is None}
    inputs = [x for _, x, _ in calls if isinstance(x, torch.Tensor) and x.requires_grad]
    reaching: set[int] = set()
    if inputs:
        variables = model.trainable_variables
        total = sum(x.float().sum() for x in inputs)
        grads = torch.autograd.grad(
            total, [v.value for v in variables], allow_unused=True, retain_graph=True
        )
        reaching = {id(v) for v, grad in zip(variables, grads) if grad is not None}
    return [
        index
        for index, tracked in enumerate(plan)
        if id(tracked.layer) in rows or any(id(v) in reaching for v in tracked.variables)
    ]


def step_coupling(
    model: Any,
    plan: Sequence[TrackedLayer],
    coupled: Sequence[int],
    calls: Sequence[tuple[Any, Any, bool]],
    per_example_losses: Any,
    grads: Sequence[Any],
) -> Coupling:
    """The step's `Coupling`; keeps the coupled layers' names for the summary.

    Args:
        model: The model.
        plan: The tracked layers.
        coupled: Positions in `plan` of the coupled layers (`coupled_positions`).
        calls: The step's BatchNormalization calls with the batch's moments.
        per_example_losses: `() -> (B,) l`, on the step's graph (its backward pass
            retained it).
        grads: The batch gradient `G`, per trainable variable (unscaled).
    """
    model.__dict__[COUPLED_NAMES_KEY] = frozenset(plan[index].name for index in coupled)
    mixing = list(dict.fromkeys(layer.name for layer, _, _ in calls))
    if not coupled:
        return Coupling(mixing=mixing)
    with torch.enable_grad():
        losses = per_example_losses().float()
    rows = CoupledRows(model, plan, coupled, losses)
    return Coupling(rows.columns(grads), mixing, rows.grams)


class CoupledRows:
    """The coupled layers' per-example gradients: rows of the Jacobian of the
    per-example losses `l` with respect to their variables, pulled back along each
    example's unit vector, `batch_normalization_chunk_size` examples at a time.

    Args:
        model: The model.
        plan: The tracked layers.
        coupled: Positions in `plan` of the coupled layers (`coupled_positions`).
        losses: The step's `(B,)` losses `l` on its graph.
    """

    def __init__(
        self, model: Any, plan: Sequence[TrackedLayer], coupled: Sequence[int], losses: Any
    ) -> None:
        self.coupled = list(coupled)
        self.groups = [[v.value for v in plan[index].variables] for index in coupled]
        self.positions = {id(v): i for i, v in enumerate(model.trainable_variables)}
        self.slots = [[self.positions[id(v)] for v in plan[index].variables] for index in coupled]
        self.losses = losses
        self.batch = int(losses.shape[0])
        chunk = int(getattr(model, "batch_normalization_chunk_size", DEFAULT_CHUNK_SIZE))
        self.chunk = max(1, min(chunk, self.batch))

    def chunks(self) -> Iterator[list[Any]]:
        """Per chunk of examples, per coupled layer, its `(n, parameters)` rows."""
        flat = [value for group in self.groups for value in group]
        for start in range(0, self.batch, self.chunk):
            count = min(self.chunk, self.batch - start)
            units = torch.zeros(count, self.batch, dtype=self.losses.dtype)
            units[torch.arange(count), start + torch.arange(count)] = 1.0
            grads = torch.autograd.grad(
                self.losses,
                flat,
                grad_outputs=units.to(self.losses.device),
                is_grads_batched=True,
                retain_graph=True,
                allow_unused=True,
            )
            found = iter(grads)
            rows = []
            for group in self.groups:
                parts = []
                for value in group:
                    grad = next(found)
                    if grad is None:
                        grad = torch.zeros((count, *value.shape), device=value.device)
                    parts.append(grad.float().reshape(count, -1))
                rows.append(torch.cat(parts, dim=1))
            yield rows

    def columns(self, grads: Sequence[Any]) -> dict[int, tuple[LayerPrimitives, Any]]:
        """`{position in plan: (primitives, ||G^(k)||^2)}`, reduced inside each chunk."""
        references = [
            torch.cat([grads[slot].float().reshape(-1) for slot in slots]) for slots in self.slots
        ]
        sq_norms: list[list[Any]] = [[] for _ in self.coupled]
        dots: list[list[Any]] = [[] for _ in self.coupled]
        sums = [torch.zeros_like(reference) for reference in references]
        for rows in self.chunks():
            for k, block in enumerate(rows):
                sq_norms[k].append((block**2).sum(dim=1))
                dots[k].append(block @ references[k])
                sums[k] = sums[k] + block.sum(dim=0)
        found = {}
        for k, index in enumerate(self.coupled):
            primitives = LayerPrimitives(
                sq_norm=torch.cat(sq_norms[k]),
                dot=torch.cat(dots[k]),
                sum_sq_norm=(sums[k] ** 2).sum(),
            )
            found[index] = (primitives, (references[k] ** 2).sum())
        return found

    def grams(self) -> dict[int, Any]:
        """`{position in plan: (B, B) <g_i, g_j>}` of the coupled layers, from all their
        rows at once (memory: B x the coupled parameters), as on TensorFlow."""
        blocks: list[list[Any]] = [[] for _ in self.coupled]
        for rows in self.chunks():
            for k, block in enumerate(rows):
                blocks[k].append(block)
        found = {}
        for k, index in enumerate(self.coupled):
            block = torch.cat(blocks[k])
            found[index] = block @ block.T
        return found


def functional_coupling(model: Any) -> frozenset[str]:
    """The names of the coupled layers, from a forward pass in training mode on zeros
    shaped as the model's functional inputs (two examples where the batch size is
    unknown; no state changes); empty for a model without such inputs, or not opted in."""
    inputs = functional_inputs(model)
    layers = opted_in_mixing_layers(model)
    if inputs is None or not layers:
        return frozenset()
    x = keras.tree.map_structure(
        lambda t: ops.zeros([2 if d is None else d for d in t.shape], t.dtype), inputs
    )
    mapping = [(v, v.value.detach().clone()) for v in model.non_trainable_variables]
    with (
        keras.StatelessScope(state_mapping=mapping),
        recording_mixing_calls(layers) as calls,
    ):
        model(x, training=True)
        plan = model.gradient_tracking_plan()
        coupled = coupled_positions(model, plan, calls)
    return frozenset(plan[index].name for index in coupled)


def layer_path(model: Any, tracked: TrackedLayer) -> str:
    """The summary's path of a layer (`ops.coupled.coupled_path`, on PyTorch)."""
    return coupled_path(model, tracked, functional_coupling)
