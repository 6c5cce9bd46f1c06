"""Attribution on a probed engine (JAX, PyTorch): products with targets' gradients and gradient sketches, in the tracked step.

A logger's requests (`engine.attribution_requests`) are computed from what the
step's one backward pass holds, as on TensorFlow:

* **Targets** (`TargetExamples`): the backend's `target_calls`, a second backward pass
  of the targets' summed per-example losses (the compiled loss, no sample weights)
  in inference mode (`training=False`) at the step's weights before its update, with
  respect to the same layers' outputs; no weight changes and no state change (the
  pass runs in a `keras.StatelessScope`). Each layer then holds the batch's factors
  and the targets' (inputs and output gradients); the `(B, T)` products
  `<g_i, g'_j>` come from the factors for Dense on 2-D inputs and Embedding
  (`attribution_math`), from both sides' per-example gradients (the layer's rule,
  or the backend's per-layer fallback) for every other layer.
* **Sketches** (`SketchRequest`): each variable's per-example gradient as a
  `(rows, cols)` matrix `M_i`, `R^T M_i C` with the projections of
  `projection_matrices` (the same seed gives the same projections as on
  TensorFlow), from the factors for Dense and Embedding.

Written once in `keras.ops`; the backends give `target_calls` and the fallback
(`backends/jax/attribution.py`, `backends/torch/attribution.py`).

Example:

```python
rows = attribution_rows(model, plan, requests, calls, values, ..., target_calls, fallback)
rows[targets.key]     # (B, T)
rows[sketch.key]      # (B, K)
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
from keras import ops

from keras_gradtrack import attribution_math, rule_math
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.protocol import TargetCalls
from keras_gradtrack.backends.ops.rules import (
    DENSE,
    EMBEDDING,
    PerExample,
    ProbedCall,
    backend_name,
)
from keras_gradtrack.backends.ops.rules import summed_per_example as rules_per_example
from keras_gradtrack.backends.ops.step import (
    ProbedPass,
    per_example_losses,
    probed_calls,
    value_lookup,
)
from keras_gradtrack.engine.attribution_requests import (
    SketchRequest,
    TargetExamples,
    matrix_sides,
    projection_matrices,
)
from keras_gradtrack.engine.refusals import uncalled_names

f32 = rule_math.f32
LayerCalls = Sequence[ProbedCall]


def refuse_unknown_requests(requests: Sequence[Any]) -> None:
    """Raises for a request the probed engines do not compute (another backend's)."""
    unknown = [r for r in requests if not isinstance(r, (TargetExamples, SketchRequest))]
    if unknown:
        raise ValueError(
            f"The {backend_name()} engine computes the rows of `TargetExamples` and `SketchRequest` "
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
    target_calls: TargetCalls,
    fallback: PerExample,
) -> dict[str, Any]:
    """`{request.key: (B, W) rows}` of the step's requests.

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
        target_calls: The backend's pass on the targets (`TargetCalls`).
        fallback: The backend's per-layer fallback (`ops.rules.PerExample`).
    """
    refuse_unknown_requests(requests)
    rows: dict[str, Any] = {}
    per_example = lazy_per_example(plan, calls, values, fallback)
    for request in requests:
        if isinstance(request, TargetExamples):
            targets = target_calls(model, plan, request, trainable, non_trainable, target_losses)
            rows[request.key] = target_products(plan, calls, targets, values, per_example, fallback)
        else:
            rows[request.key] = sketches(plan, calls, request, values, per_example)
    return rows


def requested_rows(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    requests: Sequence[Any],
    probed: ProbedPass,
    factor: Any,
    coupled: Mapping[int, Any] | None,
    target_calls: TargetCalls,
    fallback: PerExample,
) -> dict[str, Any]:
    """The rows of the loggers' attribution requests, by key (`attribution_rows`, with
    the backend's `target_calls` and `fallback`).

    Raises:
        ValueError: When a tracked layer's gradients run through a
            BatchNormalization's batch statistics (`coupled`), as on TensorFlow.
    """
    if not requests:
        return {}
    if coupled:
        names = [plan[index].name for index in sorted(coupled)]
        raise ValueError(
            "Targets and gradient sketches pair each example's gradient of a layer with "
            "the targets' gradients of that layer alone, but the gradients of layers "
            f"{names} run through a BatchNormalization's batch statistics "
            "(model.track_batch_normalization). Freeze the BatchNormalization layers or "
            "use kgt.convert_to_group_normalization(model) to log targets or sketches."
        )

    def target_losses(y: Any, y_pred: Any) -> Any:
        return per_example_losses(model, y, y_pred, None)[0]

    return attribution_rows(
        model,
        plan,
        requests,
        probed_calls(probed, factor, len(plan)),
        value_lookup(model, probed),
        probed.trainable,
        probed.non_trainable,
        target_losses,
        target_calls,
        fallback,
    )


def called_on_targets(
    plan: Sequence[TrackedLayer], per_layer: list[list[ProbedCall]]
) -> list[list[ProbedCall]]:
    """`per_layer` (a backend's `target_calls`), once every tracked layer has calls.

    Raises:
        ValueError: When the pass on the targets did not call a tracked layer.
    """
    uncalled = uncalled_names(plan, {index for index, found in enumerate(per_layer) if found})
    if uncalled:
        raise ValueError(
            f"The model's forward pass on the targets (inference mode) did not call the "
            f"tracked layers {uncalled}, so their products with the targets' gradients "
            "are not defined."
        )
    return per_layer


def lazy_per_example(
    plan: Sequence[TrackedLayer],
    calls: Sequence[LayerCalls],
    values: Callable[[Any], Any],
    fallback: PerExample,
) -> Callable[[], list[list[Any]]]:
    """A function giving every layer's per-example gradients (`layer_per_example`),
    built on its first call only (layers on factored forms may need none)."""
    built: list[list[list[Any]]] = []

    def per_example() -> list[list[Any]]:
        if not built:
            built.append(
                [
                    layer_per_example(tracked, layer_calls, values, fallback)
                    for tracked, layer_calls in zip(plan, calls)
                ]
            )
        return built[0]

    return per_example


def layer_per_example(
    tracked: TrackedLayer, calls: LayerCalls, values: Callable[[Any], Any], fallback: PerExample
) -> list[Any]:
    """Per variable of the layer (`tracked.variables`, in order), its `(B, *shape)`
    per-example gradients, summed over the layer's calls (its rule's, or the fallback's)."""
    layer = tracked.layer
    all_variables = list(layer.trainable_variables)
    trainable = [values(v) for v in all_variables]
    others = [values(v) for v in layer.non_trainable_variables]
    summed = rules_per_example(layer, tracked.rule, trainable, calls, others, fallback)
    position = {id(v): i for i, v in enumerate(all_variables)}
    return [f32(summed[position[id(v)]]) for v in tracked.variables]


def target_products(
    plan: Sequence[TrackedLayer],
    calls: Sequence[LayerCalls],
    targets: Sequence[LayerCalls],
    values: Callable[[Any], Any],
    per_example: Callable[[], list[list[Any]]],
    fallback: PerExample,
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
        target_side = [
            flat(g) for g in layer_per_example(tracked, target_layer_calls, values, fallback)
        ]
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
    projection = {
        id(v): (ops.convert_to_tensor(r), ops.convert_to_tensor(c))
        for v, (r, c) in zip(variables, matrices)
    }
    columns = []
    for index, (tracked, layer_calls) in enumerate(zip(plan, calls)):
        factored = factor_sketches(tracked, layer_calls, projection)
        if factored is None:
            factored = []
            for variable, gradient in zip(tracked.variables, per_example()[index]):
                rows, cols = matrix_sides(variable.shape)
                as_matrices = ops.reshape(gradient, (gradient.shape[0], rows, cols))
                factored.append(
                    attribution_math.projected_gradients(as_matrices, *projection[id(variable)])
                )
        columns += [flat(sketch) for sketch in factored]
    return ops.concatenate(columns, axis=1)


def flat(per_example: Any) -> Any:
    """`(B, ...)` as `(B, n)`."""
    return ops.reshape(per_example, (per_example.shape[0], -1))


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
            (
                ops.reshape(a, (a.shape[0], -1, a.shape[-1])),
                ops.reshape(d, (d.shape[0], -1, d.shape[-1])),
            )
        )
    a = ops.concatenate([a for a, _ in parts], axis=1)
    d = ops.concatenate([d for _, d in parts], axis=1)
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
        found = ops.reshape(ops.cast(call.inputs, "int32"), (batch, -1))
        ids.append(rule_math.wrapped_ids(found, rows))
        grads.append(ops.reshape(f32(call.output_grad), (batch, found.shape[1], -1)))
    return ops.concatenate(ids, axis=1), ops.concatenate(grads, axis=1)


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
