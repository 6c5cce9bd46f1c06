"""Attribution on JAX: products with targets' gradients and gradient sketches, in the tracked step.

A logger's requests (`engine.attribution_requests`) are computed from what the
step's one `jax.value_and_grad` holds, as on TensorFlow:

* **Targets** (`TargetExamples`): a second `jax.value_and_grad`, of the targets'
  summed per-example losses (the compiled loss, no sample weights) in inference
  mode (`training=False`) at the step's weights before its update, with respect to
  zero probes on the same layers; no weight gradient and no state change (the pass
  runs in a `keras.StatelessScope`). Each layer then holds the batch's factors and
  the targets' (inputs and output gradients); the `(B, T)` products
  `<g_i, g'_j>` come from the factors for Dense on 2-D inputs and Embedding
  (`attribution_math`), from both sides' per-example gradients (the layer's rule,
  or the per-layer fallback) for every other layer.
* **Sketches** (`SketchRequest`): each variable's per-example gradient as a
  `(rows, cols)` matrix `M_i`, `R^T M_i C` with the projections of
  `projection_matrices` (the same seed gives the same projections as on
  TensorFlow), from the factors for Dense and Embedding.

Example:

```python
rows = attribution_rows(model, plan, requests, probed, factor)
rows[targets.key]     # (B, T)
rows[sketch.key]      # (B, K)
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_gradtrack import attribution_math, rule_math
from keras_gradtrack.backends.jax.batchless import batchless_calls
from keras_gradtrack.backends.jax.plan import BACKEND, TrackedLayer
from keras_gradtrack.backends.jax.probes import Probes
from keras_gradtrack.backends.jax.rules import f32, summed_per_example
from keras_gradtrack.backends.ops.rules import DENSE, EMBEDDING, ProbedCall
from keras_gradtrack.engine.attribution_requests import (
    SketchRequest,
    TargetExamples,
    matrix_sides,
    projection_matrices,
)

LayerCalls = Sequence[ProbedCall]


def refuse_unknown_requests(requests: Sequence[Any]) -> None:
    """Raises for a request the JAX engine does not compute (another backend's)."""
    unknown = [r for r in requests if not isinstance(r, (TargetExamples, SketchRequest))]
    if unknown:
        raise ValueError(
            f"The {BACKEND} engine computes the rows of `TargetExamples` and `SketchRequest` "
            f"(HDF5GradientLogger's targets= and sketch_dim=). Received: "
            f"{[type(r).__name__ for r in unknown]}"
        )


def attribution_rows(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    requests: Sequence[Any],
    calls: Sequence[LayerCalls],
    values: Callable[[Any], Any],
    trainable: Sequence[Any],
    non_trainable: Sequence[Any],
    target_losses: Callable[[Any, Any], Any],
) -> dict[str, Any]:
    """`{request.key: (B, W) rows}` of the step's requests, in the compiled step.

    Args:
        model: The model.
        plan: The tracked layers.
        requests: `TargetExamples` and `SketchRequest`s.
        calls: Per layer of `plan`, its calls with output gradients `d l_i / d z_i`.
        values: variable -> its value in the step (before the update).
        trainable: The values of `model.trainable_variables`.
        non_trainable: The values of `model.non_trainable_variables`.
        target_losses: `(y, y_pred) -> (T,)` the per-example losses of the compiled
            loss, without sample weights.
    """
    refuse_unknown_requests(requests)
    rows: dict[str, Any] = {}
    per_example = lazy_per_example(plan, calls, values)
    for request in requests:
        if isinstance(request, TargetExamples):
            targets = target_calls(model, plan, request, trainable, non_trainable, target_losses)
            rows[request.key] = target_products(plan, calls, targets, values, per_example)
        else:
            rows[request.key] = sketches(plan, calls, request, values, per_example)
    return rows


def lazy_per_example(
    plan: Sequence[TrackedLayer], calls: Sequence[LayerCalls], values: Callable[[Any], Any]
) -> Callable[[], list[list[Any]]]:
    """A function giving every layer's per-example gradients (`layer_per_example`),
    built on its first call only (layers on factored forms may need none)."""
    built: list[list[list[Any]]] = []

    def per_example() -> list[list[Any]]:
        if not built:
            built.append(
                [
                    layer_per_example(tracked, layer_calls, values)
                    for tracked, layer_calls in zip(plan, calls)
                ]
            )
        return built[0]

    return per_example


def layer_per_example(
    tracked: TrackedLayer, calls: LayerCalls, values: Callable[[Any], Any]
) -> list[Any]:
    """Per variable of the layer (`tracked.variables`, in order), its `(B, *shape)`
    per-example gradients, summed over the layer's calls (its rule's, or the fallback's)."""
    layer = tracked.layer
    all_variables = list(layer.trainable_variables)
    trainable = [values(v) for v in all_variables]
    others = [values(v) for v in layer.non_trainable_variables]
    summed = summed_per_example(layer, tracked.rule, trainable, calls, others)
    position = {id(v): i for i, v in enumerate(all_variables)}
    return [f32(summed[position[id(v)]]) for v in tracked.variables]


def target_calls(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    targets: TargetExamples,
    trainable: Sequence[Any],
    non_trainable: Sequence[Any],
    target_losses: Callable[[Any, Any], Any],
) -> list[list[ProbedCall]]:
    """Per layer of `plan`, its calls on the targets with the output gradients of each
    target's own loss `l'_j` (the compiled loss in inference mode, no sample weight),
    at the given weights (`target_losses` as for `attribution_rows`)."""
    probes = Probes([tracked.layer for tracked in plan])
    mapping = [
        *zip(model.trainable_variables, trainable),
        *zip(model.non_trainable_variables, non_trainable),
    ]
    x = keras.tree.map_structure(jnp.asarray, targets.x)
    y = keras.tree.map_structure(jnp.asarray, targets.y)
    batchless: frozenset[int] = frozenset()

    def forward(probe_values: Any, data: Any) -> Any:
        x, y = data
        with (
            keras.StatelessScope(state_mapping=mapping),
            probes.installed(probe_values, batchless, len(targets)),
        ):
            prediction = model(x, training=False)
            losses = target_losses(y, prediction)
        inputs = [call_inputs for _, call_inputs, _ in probes.calls]
        return jnp.sum(losses), (inputs, list(probes.probed), probes.call_tensors())

    data = (x, y)
    # Calls on values that do not depend on the batch are made on them broadcast to it.
    batchless = batchless_calls(lambda data: forward(None, data)[1][0], data)
    shapes = jax.eval_shape(lambda data: forward(None, data), data)[1][1]
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    (_, (inputs, _, tensors)), probe_grads = jax.value_and_grad(forward, has_aux=True)(zeros, data)
    kwargs = probes.call_kwargs(tensors)
    per_layer: list[list[ProbedCall]] = [[] for _ in plan]
    for n, (index, call_kwargs) in enumerate(kwargs):
        per_layer[index].append(ProbedCall(inputs[n], call_kwargs, f32(probe_grads[n])))
    uncalled = [tracked.name for tracked, found in zip(plan, per_layer) if not found]
    if uncalled:
        raise ValueError(
            f"The model's forward pass on the targets (inference mode) did not call the "
            f"tracked layers {uncalled}, so their products with the targets' gradients "
            "are not defined."
        )
    return per_layer


def target_products(
    plan: Sequence[TrackedLayer],
    calls: Sequence[LayerCalls],
    targets: Sequence[LayerCalls],
    values: Callable[[Any], Any],
    per_example: Callable[[], list[list[Any]]],
) -> Any:
    """`(B, T)` `<g_i, g'_j>` summed over the layers."""
    products = []
    for index, (tracked, layer_calls, target_layer_calls) in enumerate(zip(plan, calls, targets)):
        factored = dense_rows_cross(tracked, layer_calls, target_layer_calls)
        if factored is None:
            factored = embedding_cross(tracked, layer_calls, target_layer_calls)
        if factored is not None:
            products.append(factored)
            continue
        batch_side = [flat(g) for g in per_example()[index]]
        target_side = [flat(g) for g in layer_per_example(tracked, target_layer_calls, values)]
        products.append(attribution_math.paired_products(batch_side, target_side))
    return sum(products[1:], products[0])


def sketches(
    plan: Sequence[TrackedLayer],
    calls: Sequence[LayerCalls],
    request: SketchRequest,
    values: Callable[[Any], Any],
    per_example: Callable[[], list[list[Any]]],
) -> Any:
    """`(B, K)`: each variable's sketch `R^T M_i C`, flattened, in the plan's order."""
    variables = [v for tracked in plan for v in tracked.variables]
    matrices = projection_matrices(request.dim, request.seed, [v.shape for v in variables])
    projection = {id(v): (jnp.asarray(r), jnp.asarray(c)) for v, (r, c) in zip(variables, matrices)}
    columns = []
    for index, (tracked, layer_calls) in enumerate(zip(plan, calls)):
        factored = factor_sketches(tracked, layer_calls, projection)
        if factored is None:
            factored = []
            for variable, gradient in zip(tracked.variables, per_example()[index]):
                rows, cols = matrix_sides(variable.shape)
                as_matrices = gradient.reshape(gradient.shape[0], rows, cols)
                factored.append(
                    attribution_math.projected_gradients(as_matrices, *projection[id(variable)])
                )
        columns += [flat(sketch) for sketch in factored]
    return jnp.concatenate(columns, axis=1)


def flat(per_example: Any) -> Any:
    """`(B, ...)` as `(B, n)`."""
    return per_example.reshape(per_example.shape[0], -1)


# -- Dense and Embedding: from the factors ----------------------------------------


def _plain(tracked: TrackedLayer, rule: Any) -> bool:
    return (
        tracked.rule is not None and tracked.rule.name == rule.name and rule.applies(tracked.layer)
    )


def _dense_sequences(calls: LayerCalls) -> tuple[Any, Any]:
    """Every call's inputs `(B, T, in)` and output gradients `(B, T, out)`, along time."""
    parts = []
    for call in calls:
        a, d = f32(call.inputs), f32(call.output_grad)
        parts.append(
            (a.reshape(a.shape[0], -1, a.shape[-1]), d.reshape(d.shape[0], -1, d.shape[-1]))
        )
    a = jnp.concatenate([a for a, _ in parts], axis=1)
    d = jnp.concatenate([d for _, d in parts], axis=1)
    return a, d


def _dense_variables(tracked: TrackedLayer) -> tuple[Any, Any]:
    by_name = {v.name: v for v in tracked.variables}
    return by_name.get("kernel"), by_name.get("bias")


def dense_rows_cross(
    tracked: TrackedLayer, calls: LayerCalls, target_calls: LayerCalls
) -> Any | None:
    """A Dense layer called once on 2-D inputs on both sides: `(a_i . a'_j + 1)(d_i . d'_j)`;
    None otherwise."""
    if not _plain(tracked, DENSE) or len(calls) != 1 or len(target_calls) != 1:
        return None
    a, d = _dense_sequences(calls)
    a2, d2 = _dense_sequences(target_calls)
    if a.shape[1] != 1 or a2.shape[1] != 1:
        return None
    kernel, bias = _dense_variables(tracked)
    return rule_math.dense_cross(
        a[:, 0], d[:, 0], a2[:, 0], d2[:, 0], kernel is not None, bias is not None
    )


def _token_sequences(tracked: TrackedLayer, calls: LayerCalls) -> tuple[Any, Any]:
    """Every call's wrapped ids `(B, T)` and output gradients `(B, T, dim)`, along time."""
    rows = tracked.layer.input_dim
    ids, grads = [], []
    for call in calls:
        batch = call.inputs.shape[0]
        found = jnp.asarray(call.inputs).astype(jnp.int32).reshape(batch, -1)
        ids.append(rule_math.wrapped_ids(found, rows))
        grads.append(f32(call.output_grad).reshape(batch, found.shape[1], -1))
    return jnp.concatenate(ids, axis=1), jnp.concatenate(grads, axis=1)


def embedding_cross(
    tracked: TrackedLayer, calls: LayerCalls, target_calls: LayerCalls
) -> Any | None:
    """An Embedding: `sum over token pairs with equal ids of d_t . d'_s`; None otherwise."""
    if not _plain(tracked, EMBEDDING):
        return None
    ids, d = _token_sequences(tracked, calls)
    target_ids, target_d = _token_sequences(tracked, target_calls)
    return attribution_math.token_cross(ids, d, target_ids, target_d)


def factor_sketches(
    tracked: TrackedLayer, calls: LayerCalls, projection: dict[int, tuple[Any, Any]]
) -> list[Any] | None:
    """A Dense or an Embedding layer's sketches from its factors (per variable, in
    order); None for another layer."""
    if _plain(tracked, EMBEDDING):
        ids, d = _token_sequences(tracked, calls)
        (table,) = tracked.variables
        return [attribution_math.token_sketches(ids, d, *projection[id(table)])]
    if not _plain(tracked, DENSE):
        return None
    a, d = _dense_sequences(calls)
    kernel, bias = _dense_variables(tracked)
    found = {}
    if kernel is not None:
        found[id(kernel)] = attribution_math.factor_sketches(a, d, *projection[id(kernel)])
    if bias is not None:
        found[id(bias)] = attribution_math.bias_sketches(d, *projection[id(bias)])
    return [found[id(v)] for v in tracked.variables]
