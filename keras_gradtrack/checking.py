"""`kgt.check`: the path each tracked layer will take, and every refusal a tracked step
would make, known before training, on every backend.

The TensorFlow engine's check is `engine/preflight.py`; the probed engines' (JAX,
PyTorch) `backends/ops/check.py`. Neither is imported before `check` is called, so
`kgt.check` on JAX or PyTorch imports no TensorFlow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

if TYPE_CHECKING:
    from keras_gradtrack.engine.tracking_check import TrackingCheck


def check(
    model: Any,
    x: Any = None,
    forms: dict[str, str] | None = None,
    *,
    y: Any = None,
    sample_weight: Any = None,
) -> TrackingCheck:
    """Which path each tracked layer of `model` will take, known before training.

    Per layer: its rule and the form the rule takes for the model's shapes
    (`materialized` or `direct`), the exact per-layer fallback (`jacobian`, slower),
    or `refused` with the error a tracked step would raise (a BatchNormalization
    in training mode, a layer inside a loop, tied weights...). The forward pass is
    traced once on symbolic inputs; nothing runs and no weight changes.

    Given a batch (`x` as arrays or tensors, with `y` where the model has a
    compiled loss), it predicts every refusal the first tracked step of `fit`
    would make: the example-independence guard runs on it (two forward passes of
    the batch, in inference mode), and the tracked step is traced on it
    (the loss' reductions, the model's own `train_step`), still without running
    anything.

    On JAX and PyTorch the rows come from the engine's plan and each rule takes its
    form from the step's shapes: the forms are those of the last tracked step, or,
    given a batch with its targets, of a step computed on it by
    `gradient_statistics` (no weight changes; its error, if any, is a refusal); `-`
    before either. A batch runs the example-independence guard, as on TensorFlow.

    Args:
        model: A model with `GradientTrackingMixin`; an unbuilt one is built from
            `x` when `x` holds values.
        x: Optional inputs (arrays, tensors or `tf.TensorSpec`s), for a subclassed
            model whose input shapes Keras does not know; with values, a batch
            to check as described above.
        forms: Forms of a traced tracked step, shown instead of the predicted ones
            (TensorFlow).
        y: The batch's targets, for the checks of the loss.
        sample_weight: The batch's sample weights, if any.

    Returns:
        A `TrackingCheck`: `.layers` (one `LayerPath` per column), `.refusals`,
        `.fallback_layers`; `str()` of it is the table
        `model.gradient_tracking_summary()` prints.

    Raises:
        TypeError: If `model` is not a Keras model with `GradientTrackingMixin`.
        ValueError: If the model is not built, or cannot be tracked at all (no
            trainable weights, variables outside layers).

    Example:

    ```python
    report = kgt.check(model)
    print(report)                  # column, layer, class, params, path, form, note
    assert not report.refusals and not report.fallback_layers
    ```
    """
    if keras.backend.backend() == "tensorflow":
        from keras_gradtrack.engine import preflight

        return preflight.check(model, x, forms, y, sample_weight)
    from keras_gradtrack.backends.ops import check as probed

    return probed.check(model, x, y, sample_weight)
