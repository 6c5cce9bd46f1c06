"""The step's payload, the same on every probed engine: the tracked layers' columns,
the statistics computed from them, and the rows of the loggers' attribution requests.

A backend hands over what differs (`protocol.Backend`: its fallback and its targets'
pass) and adds what it reads its own way (the learning rate).
"""

from __future__ import annotations

from typing import Any

import keras

from keras_gradtrack.backends.ops.attribution import requested_rows
from keras_gradtrack.backends.ops.protocol import Backend
from keras_gradtrack.backends.ops.step import (
    Columns,
    ProbedPass,
    Tracking,
    column_forms,
    columns_payload,
    layer_columns,
    needs_dots,
    opt_in_primitives,
)


def columns_and_payload(
    model: keras.Model,
    tracking: Tracking,
    probed: ProbedPass,
    losses: Any,
    factor: Any,
    exact_factor: Any,
    coupling: Any,
    backend: Backend,
    sums: dict[int, Any] | None = None,
) -> tuple[Columns, dict[str, Any]]:
    """`(columns, payload)`: the tracked layers' columns (`layer_columns`; those that
    BatchNormalization in training couples from `coupling.columns`), and from them and
    the `(B,)` losses `l_i` the step's statistics and the rows of its attribution
    requests, by key.

    Args:
        factor: `c`, with which the loss reduces the examples' losses.
        exact_factor: `c` when the loss is `c sum_i l_i` exactly (no penalties, no
            added losses), else None (`layer_columns`).
        coupling: The step's BatchNormalization coupling (`columns`: the coupled
            layers' columns by plan index; `opt_in_primitives` reads the rest).
        backend: The backend's fallback and its pass on the targets.
        sums: Filled with the summed gradients of the layers whose per-example
            gradients the step materializes (`layer_columns`), or None.
    """
    plan, statistics = tracking.plan, tracking.statistics
    dots = needs_dots(statistics)
    columns = layer_columns(model, plan, probed, factor, exact_factor, coupling.columns, sums, dots)
    # Known when the step is traced (JAX) or run (PyTorch); `kgt.check` shows them.
    model.gradient_tracking.forms = column_forms(plan, columns, coupling.columns)
    opt_in = opt_in_primitives(model, plan, statistics, probed, factor, coupling)
    payload = columns_payload(statistics, columns, losses, int(losses.shape[0]), opt_in)
    rows = requested_rows(
        model,
        plan,
        tracking.requests,
        probed,
        factor,
        coupling.columns,
        backend.target_calls,
        backend.fallback,
    )
    payload.update(rows)
    return columns, payload
