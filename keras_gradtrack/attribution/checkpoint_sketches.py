"""Examples' gradient sketches at each checkpoint of a log, on either backend.

`estimate_influence` and `sketch_examples` need examples' sketches at the weights of
every checkpoint the logger saved. The checks (a checkpoint to load, a built model of
the log's architecture) and the walk over the checkpoints are the same on both
backends; only the compiled sketch function is the engine's own
(`attribution/sketches.py` on TensorFlow, `backends/jax/target_sketches.py` on
JAX, `backends/torch/attribution.py` on PyTorch). No backend is imported here.

Example:

```python
found = checkpoint_sketches(model, 16, 0, widths, log.checkpoints(), [(x, y, None)],
                            build_plan, sketch_function)
found[0]    # (n, K) at the weights of step 0
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from keras_gradtrack.engine.attribution_requests import sketch_widths
from keras_gradtrack.io.checkpoints import load_checkpoint


class SketchFunction(Protocol):
    """An engine's compiled sketches of examples (`attribution.sketches.sketch_function`
    on TensorFlow, `backends.jax.target_sketches.sketch_function` on JAX,
    `backends.torch.attribution.sketch_function` on PyTorch)."""

    def __call__(self, model: Any, plan: Any, dim: int, seed: int) -> Callable[..., Any]:
        """`compute`, whose `compute(x, y, sample_weight)` gives the `(n, K)` sketches of
        the examples `(x, y)` at the model's weights when it is called (loading other
        weights, or other examples of the same shapes, needs no new trace). The
        gradients are those of the compiled loss, `sample_weight` (or None) included,
        in inference mode.

        Args:
            model: A built model of the log's architecture.
            plan: Its tracking plan, checked against the log.
            dim: The sketches' `dim`.
            seed: The sketches' seed.
        """
        ...


def checkpoint_sketches(
    model: Any,
    dim: int,
    seed: int,
    widths: Sequence[int],
    checkpoints: Mapping[int, Path],
    batches: Sequence[tuple[Any, Any, Any]],
    build_plan: Callable[[Any], Any],
    sketch_function: SketchFunction,
) -> dict[int, np.ndarray]:
    """`{step: (n, K) sketches}` of the examples at each checkpoint's weights, the
    batches' rows in order; the model's own weights are put back afterwards.

    Args:
        model: A built model of the log's architecture.
        dim: The sketches' `dim`.
        seed: The sketches' seed.
        widths: The log's width of each sketched variable, to check the model with.
        checkpoints: `{step: weights file}`, as `io.checkpoints.checkpoints` lists them.
        batches: The examples, as `(x, y, sample_weight)` batches (`sample_weight` may
            be None).
        build_plan: The engine's tracking plan of the model (its tracked layers, each
            with its `variables`).
        sketch_function: The engine's compiled sketches (see `SketchFunction`), built
            once and called on every batch at each checkpoint.

    Raises:
        ValueError: if there is no checkpoint, the model is not built, or its tracked
            variables differ from the log's in number or in shape (their names may
            differ: a model built anew numbers its layers on).
    """
    if not checkpoints:
        raise ValueError(
            "Sketches at checkpoints need the weights saved during training; the log has no "
            "checkpoint (HDF5GradientLogger(sketch_dim=..., checkpoint_every=...) saves them)."
        )
    if not model.built:
        raise ValueError(
            f"Expected a built model of the log's architecture. Received: model "
            f"{model.name!r}, not built yet (call it on a batch first)."
        )
    plan = build_plan(model)
    found = sketch_widths([v for tracked in plan for v in tracked.variables], dim)
    if [width for _, width in found] != list(widths):
        raise ValueError(
            "Expected a model of the architecture the log was written with: the sketched "
            f"variables differ. Expected (in the log) widths {list(widths)}. Received: "
            f"{found}"
        )
    compute = sketch_function(model, plan, dim, seed)
    original = [np.array(w) for w in model.get_weights()]
    try:
        sketches = {}
        for step, path in sorted(checkpoints.items()):
            load_checkpoint(model, path)
            found_rows = [np.asarray(compute(*batch)) for batch in batches]
            sketches[step] = np.concatenate(found_rows)
        return sketches
    finally:
        model.set_weights(original)
