"""The tracked step's math over `keras.ops`, shared by the probed engines (JAX, PyTorch).

A backend runs the forward pass with probes on the tracked layers' (pre-activation)
outputs and differentiates the loss with respect to the trainable variables and the
probes in one backward pass (`ProbedPass`); from there everything is here: the
per-example losses `l_i` and the loss's factor `c`, each layer's primitives from its
rule (or the backend's fallback), and the statistics.

Example:

```python
losses, factor = per_example_losses(model, y, y_pred, sample_weight)
columns = layer_columns(model, plan, probed, factor, exact_factor=factor)
payload = columns_payload(statistics, columns, losses, batch)
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras
from keras import ops, tree

from keras_gradtrack import rule_math
from keras_gradtrack._keras_seam import LossFunctionWrapper, compiled_loss_weights
from keras_gradtrack.backends.ops.rules import (
    LayerPrimitives,
    PerExample,
    ProbedCall,
    backend_name,
    summed_per_example,
)
from keras_gradtrack.engine.reductions import (
    MEAN_REDUCTIONS,
    LossRecorder,
    refuse_unknown_reductions,
)
from keras_gradtrack.engine.reductions import loss_factor as reductions_loss_factor
from keras_gradtrack.engine.refusals import refuse_uncalled_layers
from keras_gradtrack.engine.tracking_check import COUPLED, DIRECT, JACOBIAN, MATERIALIZED
from keras_gradtrack.rule_math import f32
from keras_gradtrack.statistics import Statistic, StepPrimitives

if TYPE_CHECKING:
    from keras_gradtrack.backends.ops.plan import TrackedLayer

EXAMPLE_ID_KEY = "example_id"


def split_example_ids(data: Any) -> tuple[Any, Any]:
    """`(data without ids, ids or None)`: a dict `x` holding `"example_id"` loses the key
    (and, with exactly one other entry, becomes that entry's value)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if not isinstance(x, dict) or EXAMPLE_ID_KEY not in x:
        return data, None
    rest = {k: v for k, v in x.items() if k != EXAMPLE_ID_KEY}
    ids = x[EXAMPLE_ID_KEY]
    x = next(iter(rest.values())) if len(rest) == 1 else rest
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight), ids


def batch_size_of(x: Any) -> int:
    return int(next(t for t in tree.flatten(x) if t is not None).shape[0])


def loss_object(model: keras.Model) -> Any:
    """The compiled loss as one `keras.losses.Loss`, or a clear refusal."""
    loss = model.loss
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss
    if callable(loss):
        return LossFunctionWrapper(loss)
    raise ValueError(
        f"On the {backend_name()} backend a tracked model is compiled with one loss (a name, a "
        f"function or a keras.losses.Loss) for its one output. Received: loss={loss!r}"
    )


def one_loss_of_one_output(model: keras.Model, data: Any) -> bool:
    """Whether the compiled loss is one loss (not a list or dict of them), without loss
    weights, and the batch's targets are one tensor (or none; not a list or dict, even
    of one)."""
    y = keras.utils.unpack_x_y_sample_weight(data)[1]
    if isinstance(model.loss, (dict, list, tuple)) or keras.tree.is_nested(y):
        return False
    return compiled_loss_weights(model) is None


def recorded_loss_factor(recorder: LossRecorder, batch: int) -> Any:
    """`c` (`L = c sum_i l_i`) of the losses a step recorded (`engine/reductions.py`),
    which must share one.

    Raises:
        ValueError: When no Keras loss reduced per-example values, a loss used a
            reduction without a per-example factor, or the losses' factors differ.
    """
    refuse_unknown_reductions(recorder)
    if not recorder.records:
        raise ValueError(
            f"On the {backend_name()} backend the per-example losses l_i come from the "
            "Keras losses the differentiated function computes (a `keras.losses.Loss`, "
            "the compiled loss through `self.compute_loss`, or "
            "`self.compute_loss_and_updates`), and it computed none that reduces "
            f"per-example values (a loss reduced to one value itself: "
            f"{recorder.whole_batch}). Compute the loss with a keras.losses.Loss."
        )
    for record in recorder.records:
        if record.values.shape[0] != batch:
            raise ValueError(
                f"A loss of this step reduced values of shape {tuple(record.values.shape)}, "
                f"whose first axis is not the batch (of {batch} examples), so its "
                "per-example losses are not defined."
            )
    return reductions_loss_factor(recorder.records, batch)


def per_example_losses(
    model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
) -> tuple[Any, float]:
    """`(l, c)`: the `(B,)` losses `l_i` (sample weights included) and the factor `c`
    with which the compiled loss reduces them (`loss = c sum_i l_i`)."""
    loss = loss_object(model)
    if loss.reduction not in (*MEAN_REDUCTIONS, "sum"):
        raise ValueError(
            f"On the {backend_name()} backend a tracked model's loss reduces with "
            f"'sum_over_batch_size' (the default) or 'sum'. Received: reduction={loss.reduction!r}"
        )
    y_pred = keras.ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    y = keras.ops.convert_to_tensor(y, dtype=loss.dtype)
    values = f32(loss.call(y, y_pred))
    batch = values.shape[0]
    if sample_weight is not None:
        weights = f32(sample_weight)
        while weights.ndim > values.ndim and weights.shape[-1] == 1:
            weights = weights[..., 0]
        weights = ops.reshape(weights, tuple(weights.shape) + (1,) * (values.ndim - weights.ndim))
        values = values * weights
    per_example = ops.sum(ops.reshape(values, (batch, -1)), axis=1)
    if loss.reduction in MEAN_REDUCTIONS:
        elements = math.prod(values.shape[1:])
        return per_example / elements, 1.0 / batch
    return per_example, 1.0


def layer_primitives(
    tracked: TrackedLayer,
    calls: Sequence[ProbedCall],
    lookup_value: Any,
    lookup_gradient: Any,
    fallback: PerExample,
    factor: float | None = None,
    sums: dict[int, Any] | None = None,
    dots: bool = True,
) -> tuple[LayerPrimitives, Any]:
    """One layer's primitives and `||G^(k)||^2`, from its calls in the step (`dot`
    None where not `dots`: no statistic of the step reads it, and an eager backend
    then forms no product with the batch gradient).

    With `factor` (`c`, when the loss is `c sum_i l_i` and nothing else), `||sum_i
    g_i||^2` is `||G||^2 / c^2`, and what the rule computes for it is left unused
    (the compiler drops it). With `sums` too, a layer whose per-example gradients are
    materialized takes its batch gradient as `c sum_i g_i` (kept in `sums` by
    variable id, for the optimizer): the backward pass's own weight gradient of the
    layer is then unused, and the compiler drops it (for the rules that ask for it:
    `ProbedRule.sums_batch_gradient`).
    """
    primitives, reference_sq_norm = _layer_primitives(
        tracked,
        calls,
        lookup_value,
        lookup_gradient,
        fallback,
        None if factor is None else sums,
        factor,
        dots,
    )
    if factor is not None and reference_sq_norm is not None:
        sum_sq_norm = reference_sq_norm / factor**2
        primitives = dataclasses.replace(primitives, sum_sq_norm=sum_sq_norm)
    return primitives, reference_sq_norm


def _layer_primitives(
    tracked: TrackedLayer,
    calls: Sequence[ProbedCall],
    lookup_value: Any,
    lookup_gradient: Any,
    fallback: PerExample,
    sums: dict[int, Any] | None = None,
    factor: float | None = None,
    dots: bool = True,
) -> tuple[LayerPrimitives, Any]:
    layer = tracked.layer
    all_variables = list(layer.trainable_variables)
    gradients = [lookup_gradient(v) for v in all_variables]
    positions = {id(v): i for i, v in enumerate(all_variables)}
    own = [positions[id(v)] for v in tracked.variables]
    references: list[Any] | None = None
    reference_sq_norm = None  # without a batch gradient (`ProbedPass.grads` None)
    if not any(g is None for g in gradients):
        references = [f32(g) for g in gradients]
        reference_sq_norm = sum(ops.sum(references[i] ** 2) for i in own)
    dots = dots and references is not None
    rule = tracked.rule
    direct = direct_primitives(tracked, calls, references if dots else None)
    if direct is not None:
        return direct, reference_sq_norm
    values = [lookup_value(v) for v in all_variables]
    others = [lookup_value(v) for v in layer.non_trainable_variables]
    summed = summed_per_example(layer, rule, values, calls, others, fallback)
    batch = summed[0].shape[0]
    flat = ops.concatenate([ops.reshape(summed[i], (batch, -1)) for i in own], axis=1)
    total = ops.sum(flat, axis=0)
    summing = sums is not None and factor is not None
    if summing and rule is not None and rule.sums_batch_gradient:
        # G^(k) = c sum_i g_i exactly: the per-example gradients' sum serves as the
        # batch gradient of a kernel (as on TensorFlow), and the backward's own one goes
        # unused. A bias keeps the backward's (a cheap sum either way).
        reference = factor * total
        reference_sq_norm = ops.sum(reference**2)
        start = 0
        for i in own:
            size = math.prod(summed[i].shape[1:])
            if all_variables[i].name != "bias":
                sums[id(all_variables[i])] = ops.reshape(
                    reference[start : start + size], tuple(summed[i].shape[1:])
                )
            start += size
    elif dots:
        assert references is not None
        reference = ops.concatenate([ops.reshape(references[i], (-1,)) for i in own])
    dot = ops.matmul(flat, reference) if dots else None
    primitives = LayerPrimitives(ops.sum(flat**2, axis=1), dot, ops.sum(total**2), summed)
    return primitives, reference_sq_norm


@dataclasses.dataclass(frozen=True)
class Tracking:
    """What a tracked step computes besides Keras' update.

    Attributes:
        plan: The tracked layers.
        statistics: The statistics asked for.
        requests: The loggers' attribution requests.
        private: For a private model, `(model, plan, probed, columns, factor,
            added_losses, optimizer_variables, loss_scale) -> (gradients, rows)`: what
            the optimizer receives in place of the batch gradient (times the loss
            scale, which it unscales) and the values it adds to the logs
            (`private_step.py`); None otherwise.
        batchless: The positions (in call order) of the probed calls whose input does
            not follow the batch, where the backend finds them once per plan (PyTorch);
            JAX finds them as it traces each step.
    """

    plan: Sequence[TrackedLayer]
    statistics: Sequence[Statistic]
    requests: Sequence[Any] = ()
    private: Callable[..., Any] | None = None
    batchless: frozenset[int] = frozenset()


def direct_primitives(
    tracked: TrackedLayer, calls: Sequence[ProbedCall], references: Sequence[Any]
) -> LayerPrimitives | None:
    """The layer's primitives by its rule's direct form (one call, and the rule takes
    it for these shapes), else None: its primitives then come from its per-example
    gradients (`summed_per_example`)."""
    rule = tracked.rule
    if len(calls) == 1 and rule is not None and rule.primitives is not None:
        return rule.primitives(tracked.layer, calls[0], references)
    return None


@dataclasses.dataclass(frozen=True)
class ProbedPass:
    """What the backend's one backward pass over the variables and the probes gives.

    Attributes:
        calls: Per probed call, `(position of its layer in the plan, its kwargs)`.
        inputs: Per probed call, the layer's inputs.
        probe_grads: Per probed call, its probe's gradient (`c d l_i / d z_i`).
        trainable: The values of `model.trainable_variables` differentiated at.
        non_trainable: The values of `model.non_trainable_variables`.
        grads: The gradients of the loss with respect to `trainable` (`G`); None
            where the step computed none (a private step with nothing to log: the
            columns then hold no `||G^(k)||^2`).
        fallback: The backend's exact per-layer fallback (`PerExample`: a layer's
            per-example gradients from its inputs and output gradients), for the
            layers without a rule.
        input_grads: Per probed float input of the model, its probe's gradient
            (`c d l_i / d x_i`), when a statistic asks for them.
    """

    calls: Sequence[tuple[int, dict[str, Any]]]
    inputs: Sequence[Any]
    probe_grads: Sequence[Any]
    trainable: Sequence[Any]
    non_trainable: Sequence[Any]
    grads: Sequence[Any] | None
    fallback: PerExample
    input_grads: Sequence[Any] = ()


Columns = list[tuple[LayerPrimitives, Any]]


def layer_columns(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    probed: ProbedPass,
    factor: Any,
    exact_factor: Any,
    coupled: Mapping[int, tuple[LayerPrimitives, Any]] | None = None,
    sums: dict[int, Any] | None = None,
    dots: bool = True,
) -> Columns:
    """Per tracked layer, its primitives and `||G^(k)||^2` (`layer_primitives`), from
    the probed pass and the loss's factor `c` (`loss = c sum_i l_i`, plus penalties
    unless `exact_factor`, which is then `c`); the columns in `coupled` (by position
    in the plan) are given (`coupled.py`). Without `dots` (no statistic reads them:
    `needs_dots`) the layers' `dot` is None where their rules can leave it out."""
    refuse_uncalled_layers(plan, {index for index, _ in probed.calls})
    lookup_value = value_lookup(model, probed)
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}

    def lookup_gradient(variable: Any) -> Any:
        return None if probed.grads is None else probed.grads[position[id(variable)]]

    columns = []
    for index, (layer_calls, tracked) in enumerate(
        zip(probed_calls(probed, factor, len(plan)), plan)
    ):
        if coupled and index in coupled:
            columns.append(coupled[index])
            continue
        if exact_factor is not None and len(layer_calls) == 1:
            layer_calls = [dataclasses.replace(layer_calls[0], reference_factor=exact_factor)]
        columns.append(
            layer_primitives(
                tracked,
                layer_calls,
                lookup_value,
                lookup_gradient,
                probed.fallback,
                exact_factor,
                sums,
                dots,
            )
        )
    return columns


def column_forms(
    plan: Sequence[TrackedLayer], columns: Columns, coupled: Mapping[int, Any] | None
) -> dict[str, str]:
    """Column name -> the form its layer took in the step, as the TensorFlow engine names
    them (`engine/tracking_check.py`): `coupled` (BatchNormalization in training couples its
    rows), `jacobian` (the fallback), `materialized` (the rule's per-example gradients),
    `direct` (the rule's primitives without them)."""
    forms = {}
    for index, (tracked, (primitives, _)) in enumerate(zip(plan, columns)):
        if coupled and index in coupled:
            form = COUPLED
        elif tracked.rule is None:
            form = JACOBIAN
        elif primitives.per_example is not None or primitives.materialized:
            form = MATERIALIZED
        else:
            form = DIRECT
        forms[tracked.name] = form
    return forms


def needs_dots(statistics: Sequence[Statistic]) -> bool:
    """Whether a statistic of the step reads `<g_i^(k), G^(k)>` (`Statistic.needs_dot`)."""
    return any(statistic.needs_dot for statistic in statistics)


def columns_payload(
    statistics: Sequence[Statistic],
    columns: Columns,
    losses: Any,
    batch: int,
    opt_in: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Each statistic of the step, from its layers' columns, the losses `l_i` and the
    opt-in primitives (`opt_in_primitives`)."""
    if not statistics:
        return {}
    opt_in = opt_in or {}
    dots = needs_dots(statistics)
    primitives = StepPrimitives(
        loss=losses,
        sq_norm=ops.stack([c.sq_norm for c, _ in columns], axis=1),
        dot=ops.stack([c.dot for c, _ in columns], axis=1) if dots else None,
        reference_sq_norm=ops.stack([r for _, r in columns]),
        sum_sq_norm=ops.stack([c.sum_sq_norm for c, _ in columns]),
        batch_size=ops.convert_to_tensor(batch, "float32"),
        gram=opt_in.get("gram"),
        input_sq_norm=opt_in.get("input_sq_norm"),
    )
    return {s.name: f32(s.compute(primitives)) for s in statistics}


def value_lookup(model: keras.Model, probed: ProbedPass) -> Any:
    """variable -> its value in the probed pass (trainable or not)."""
    return variable_values(model, probed.trainable, probed.non_trainable)


def variable_values(
    model: keras.Model, trainable: Sequence[Any], non_trainable: Sequence[Any]
) -> Callable[[Any], Any]:
    """variable -> its value among `trainable` and `non_trainable`, the values of
    `model.trainable_variables` and `model.non_trainable_variables` in their order."""
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    others = {id(v): i for i, v in enumerate(model.non_trainable_variables)}

    def lookup_value(variable: Any) -> Any:
        if id(variable) in position:
            return trainable[position[id(variable)]]
        return non_trainable[others[id(variable)]]

    return lookup_value


def probed_calls(probed: ProbedPass, factor: Any, layers: int) -> list[list[ProbedCall]]:
    """Per tracked layer, its calls with the output gradients `d l_i / d z_i` (the
    probes' gradients divided by the loss's factor `c`)."""
    calls: list[list[ProbedCall]] = [[] for _ in range(layers)]
    for n, (owner, kwargs) in enumerate(probed.calls):
        calls[owner].append(
            ProbedCall(probed.inputs[n], kwargs, f32(probed.probe_grads[n]) / factor)
        )
    return calls


def input_sq_norm(input_grads: Sequence[Any], factor: Any) -> Any:
    """`(B,)` `||d l_i / d x_i||^2` over the probed inputs, from their probes' gradients
    `c d l_i / d x_i` (unscaled) and `c`."""
    terms = [
        ops.sum(ops.reshape(f32(g) / factor, (g.shape[0], -1)) ** 2, axis=1) for g in input_grads
    ]
    return sum(terms[1:], terms[0])


def layer_gram(
    tracked: TrackedLayer,
    calls: Sequence[ProbedCall],
    lookup_value: Callable[[Any], Any],
    fallback: PerExample,
) -> Any:
    """`(B, B)` `<g_i^(k), g_j^(k)>` of one tracked layer: its rule's factored form (one
    call, every trainable variable of the layer tracked), else from its per-example
    gradients."""
    layer, rule = tracked.layer, tracked.rule
    all_variables = list(layer.trainable_variables)
    whole = len(tracked.variables) == len(all_variables)
    if len(calls) == 1 and whole and rule is not None and rule.gram is not None:
        gram = rule.gram(layer, calls[0])
        if gram is not None:
            return gram
    values = [lookup_value(v) for v in all_variables]
    others = [lookup_value(v) for v in layer.non_trainable_variables]
    summed = summed_per_example(layer, rule, values, calls, others, fallback)
    own = {id(v) for v in tracked.variables}
    batch = summed[0].shape[0]
    flat = [ops.reshape(g, (batch, -1)) for v, g in zip(all_variables, summed) if id(v) in own]
    return rule_math.per_example_gram(flat)


def opt_in_primitives(
    model: keras.Model,
    plan: Sequence[TrackedLayer],
    statistics: Sequence[Statistic],
    probed: ProbedPass,
    factor: Any,
    coupling: Any = None,
) -> dict[str, Any]:
    """What the opt-in statistics need: the Gram matrix `(B, B)` summed over the layers
    (each layer's factored form or per-example gradients; a coupled layer's from its
    rows: `coupling`, an `ops.coupled.Coupling`), and the input gradients' `(B,)`
    squared norms.

    Raises:
        ValueError: For input gradients where a BatchNormalization in training mixes
            the examples (as on TensorFlow).
    """
    found: dict[str, Any] = {}
    if probed.input_grads and coupling is not None and coupling.mixing:
        needing = [s.name for s in statistics if s.needs_input_gradients]
        raise ValueError(
            f"Layer {coupling.mixing[0]!r} is a BatchNormalization in training mode, so "
            "every example's loss depends on every input of the batch, and the backward "
            "pass does not give d l_i / d x_i. Expected statistics without input "
            f"gradients. Received: {needing}"
        )
    if any(statistic.needs_gram for statistic in statistics):
        lookup_value = value_lookup(model, probed)
        coupled_grams = coupling.grams() if coupling is not None and coupling.columns else {}
        grams = [
            coupled_grams[index]
            if index in coupled_grams
            else layer_gram(tracked, layer_calls, lookup_value, probed.fallback)
            for index, (layer_calls, tracked) in enumerate(
                zip(probed_calls(probed, factor, len(plan)), plan)
            )
        ]
        found["gram"] = sum(grams[1:], grams[0])
    if probed.input_grads:
        found["input_sq_norm"] = input_sq_norm(probed.input_grads, factor)
    return found
