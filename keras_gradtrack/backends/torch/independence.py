"""The example-independence guard on PyTorch: the same two inference passes.

As on TensorFlow and JAX (`engine/example_independence.py` holds the comparison and
the refusal), the model runs in inference mode on a batch and on the same batch with
its second half replaced by the first half's examples reversed; the first half's
outputs and per-example losses must not change. Both passes run without gradients,
inside a `keras.StatelessScope` holding the variables' values: whatever a layer
assigns stays in the scope, so no state and no metric of the model changes.

Example:

```python
assert find_example_mixing(model, x, y) is None     # the examples do not mix
```
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch

from keras_gradtrack._keras_seam import compute_loss
from keras_gradtrack.engine import example_independence as independence
from keras_gradtrack.engine import reductions


class ExampleIndependenceChecks(independence.ExampleIndependenceSetting):
    """The guard's part of the PyTorch engine's `GradientTrackingMixin`: the setting,
    and the check before the first tracked step of a fit (or a loop of
    `train_on_batch`) that wants it, once per model, compiled loss and batch signature
    (as on the other backends; `ops.mixin.ProbedTrackingMixin` says whether one is)."""

    def _check_independence_once(self, data: Any) -> None:
        guard = self.__dict__.get("_independence_guard")
        if guard is None or not guard.wanted:
            return
        guard.wanted = False
        self._check_examples_independent(data)

    def _find_example_mixing(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> independence.Mixing | None:
        """The guard on one batch at the current weights (`kgt.check`'s), not remembered."""
        return find_example_mixing(self, x, y, sample_weight)

    def _check_examples_independent(self, data: Any) -> None:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        independence.checked_once(
            self,
            (x, y, sample_weight),
            lambda: find_example_mixing(self, x, y, sample_weight),
        )


def find_example_mixing(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> independence.Mixing | None:
    """Runs the guard on one batch: `Mixing` where it fails, None where it holds."""

    def passes(batch: tuple[Any, ...], variant: tuple[Any, ...]) -> Any:
        return forward(model, *batch), forward(model, *variant)

    return independence.find_mixing(x, y, sample_weight, passes)


def forward(model: Any, x: Any, y: Any, sample_weight: Any) -> dict[str, np.ndarray]:
    """`{what: (B, ...) values}`: the outputs and, with targets, the per-example sums of
    the weighted values each Keras loss reduces (the compiled loss, several outputs
    too), at the variables' current values, changing nothing."""
    mapping = [(v, v.value.detach().clone()) for v in [*model.variables, *model.metrics_variables]]
    with (
        torch.no_grad(),
        keras.StatelessScope(state_mapping=mapping),
        reductions.recording_losses(lambda values, position: values) as recorder,
    ):
        y_pred = model(x, training=False)
        if y is not None and model.loss is not None:
            compute_loss(model, x, y, y_pred, sample_weight, training=False)
    found = independence.compared_values(y_pred, recorder.records)
    return {name: keras.ops.convert_to_numpy(value) for name, value in found.items()}
