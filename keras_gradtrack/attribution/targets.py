"""Products of each example's gradient with fixed targets' gradients, in the tracked step.

TracIn (Pruthi et al. 2020) scores how much training on example i moved the loss
on a target z': `sum_t lr_t <g_i(theta_t), g_z'(theta_t)>`. A logger given targets
asks every tracked step for the `(B, T)` products `<g_i, g_j'>` at the weights of
that step, before its update (`TargetSet`). The step runs the targets' own
forward and backward pass (inference mode, the compiled loss, the same taps), so
each layer holds the batch's factors and the targets' (inputs and output
gradients); a rule's `cross` turns the two into the products without building
a gradient (Dense: `(a_i . a'_j + 1)(d_i . d'_j)`), other layers pair per-example
gradients. The target pass changes neither the update nor any metric.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree

from keras_gradtrack._keras_seam import compiled_loss
from keras_gradtrack._patching import patched_each
from keras_gradtrack.engine import losses, reductions
from keras_gradtrack.engine.attribution_requests import TargetExamples
from keras_gradtrack.engine.backward import Calls, with_output_gradients
from keras_gradtrack.engine.data import check_example_ids
from keras_gradtrack.engine.fallback import per_example_gradients
from keras_gradtrack.engine.plan import Plan, TrackedLayer
from keras_gradtrack.engine.requests import BatchGradients
from keras_gradtrack.engine.taps import LayerTap, installed
from keras_gradtrack.engine.tracking_check import MATERIALIZED
from keras_gradtrack.rules.ops import cross_of, flat_per_example


class TargetSet(TargetExamples):
    """`TargetExamples` (its arguments, rows and checks) whose products the TensorFlow
    engine computes in its tracked step.

    Example:

    ```python
    targets = TargetSet({"pixels": x_test[:64], "example_id": test_ids[:64]}, y_test[:64])
    ```
    """

    def __init__(self, x: Any, y: Any):
        check_example_ids(x)
        super().__init__(x, y)
        self.x = tree.map_structure(_as_tensor, self.x)
        self.y = tree.map_structure(_as_tensor, self.y)

    def rows(self, batch: BatchGradients) -> tf.Tensor:
        target_calls, target_factor = target_pass(
            batch.model, batch.plan, self.x, self.y, batch.loss_scale, batch.xla
        )
        products = []
        for tracked, calls, targets, form in zip(
            batch.plan, batch.calls, target_calls, batch.forms
        ):
            products.append(layer_cross(tracked, calls, targets, form, batch.per_example))
        return tf.add_n(products) / (batch.factor * target_factor)


def target_pass(
    model: Any,
    plan: Plan,
    x: Any,
    y: Any,
    loss_scale: tf.Tensor | None = None,
    xla: bool = False,
    sample_weight: Any = None,
) -> tuple[tuple[Calls, ...], tf.Tensor]:
    """The targets' forward and backward pass at the current weights, in inference mode.

    Args:
        model: The model (its taps uninstalled).
        plan: The layers to tap.
        x: The targets' inputs.
        y: Their labels.
        loss_scale: The step's loss scale (float16 gradients stay in range), or None.
        xla: The pass is traced in a step compiled by XLA.
        sample_weight: The targets' sample weights for the compiled loss, or None.

    Returns:
        Per layer of `plan`, its calls on the targets with their output gradients
        (in the targets' rules' scale), and that scale's factor `c' s`.

    Raises:
        ValueError: if the model has no compiled loss.
    """
    if compiled_loss(model) is None:
        raise ValueError(
            f"Targets' gradients need the loss of `compile(loss=...)`; model {model.name!r} "
            "was compiled without one."
        )
    taps = [LayerTap(tracked.layer, tracked.rule, xla=xla) for tracked in plan]
    with (
        installed(taps),
        losses.recording_losses() as recorder,
        silenced_loss_metrics(model),
        tf.GradientTape() as tape,
    ):
        prediction = model(x, training=False)  # Keras drops it where `call` has none
        loss = compiled_loss(model)(y, prediction, sample_weight)
        if loss_scale is not None:
            loss = loss * tf.cast(loss_scale, loss.dtype)
    reductions.refuse_unknown_reductions(recorder)
    tapped = [t for tap in taps for recorded in tap.recorded for t in recorded.call.tapped]
    values = [record.values for record in recorder.records]
    gradients = tape.gradient(loss, [*tapped, *values])
    connected = [r for r, g in zip(recorder.records, gradients[len(tapped) :]) if g is not None]
    factor = losses.loss_factor(connected, tf.shape(tree.flatten(x)[0])[0])
    if loss_scale is not None:
        factor = factor * loss_scale
    calls = [tuple(recorded.call for recorded in tap.recorded) for tap in taps]
    return with_output_gradients(calls, gradients[: len(tapped)]), factor


def layer_cross(
    tracked: TrackedLayer,
    calls: Calls,
    target_calls: Calls,
    form: str,
    per_example: dict[int, tf.Tensor],
) -> tf.Tensor:
    """`(B, T)` products of one layer's per-example gradients with the targets'.

    A materialized layer pairs the per-example gradients the step built; a rule's
    `cross` works from the factors; otherwise both sides' per-example gradients.
    """
    rule = tracked.rule
    if form != MATERIALIZED and rule is not None and rule.cross is not None:
        return rule.cross(tracked.layer, calls, target_calls)
    if form == MATERIALIZED:
        batch_gradients = [per_example[id(v)] for v in tracked.variables]
    else:
        batch_gradients = layer_per_example(tracked, calls)
    target_gradients = layer_per_example(tracked, target_calls)
    return cross_of(batch_gradients, target_gradients)


def layer_per_example(tracked: TrackedLayer, calls: Calls) -> list[tf.Tensor]:
    """Per variable of the layer, in order, its `(B, n)` per-example gradients."""
    rule = tracked.rule
    if rule is None or rule.per_example is None:
        flat = per_example_gradients(tracked.layer, tracked.variables, calls)
        sizes = [int(np.prod(v.shape)) for v in tracked.variables]
        return list(tf.split(flat, sizes, axis=1))
    by_variable = {id(v): flat_per_example(g) for v, g in rule.per_example(tracked.layer, calls)}
    return [by_variable[id(v)] for v in tracked.variables]


@contextlib.contextmanager
def silenced_loss_metrics(model: Any) -> Iterator[None]:
    """The compiled loss's per-output loss trackers ignore updates for the block.

    With several outputs, Keras' compiled loss updates a `<loss>_loss` metric per
    output whenever it runs; the targets' loss must not.
    """
    metrics = list(getattr(compiled_loss(model), "metrics", []))
    with patched_each((metric, "update_state", _ignored) for metric in metrics):
        yield


def _ignored(*args: Any, **kwargs: Any) -> None:
    return None


def _as_tensor(array: Any) -> Any:
    return None if array is None else tf.constant(array)
