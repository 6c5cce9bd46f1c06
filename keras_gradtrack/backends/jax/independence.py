"""The example-independence guard on JAX: the same two inference passes, statelessly.

As on TensorFlow (`engine/independence.py`, whose comparison and refusal this
uses: `engine/example_independence.py`), the model runs in inference mode on a
batch and on the same batch with its second half replaced by the first half's
examples reversed; the first half's outputs and per-example losses (the sums of
the weighted values each Keras loss reduces) must not change. Here both passes
run inside a `keras.StatelessScope` mapping the model's variables to the step's
state: whatever a layer or the loss assigns stays in the scope, so no state and
no metric of the model changes, and the weights are those of the step about to run.
`ExampleIndependenceChecks` is the mixin's part of it: the setting
`check_example_independence`, and the check once per model, compiled loss and
batch signature, as on TensorFlow (a later fit of the same kind skips it).

Example:

```python
mixing = find_example_mixing(model, state, x, y)     # state: Keras' four-part state
if mixing is not None:
    raise mixing_error(model, mixing)
```
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np

from keras_gradtrack._keras_seam import compute_loss
from keras_gradtrack.backends.jax.distribution import on_host
from keras_gradtrack.backends.jax.losses import recording_losses
from keras_gradtrack.engine.example_independence import (
    ExampleIndependenceSetting,
    Mixing,
    checked_once,
    compared_values,
    find_mixing,
)


class ExampleIndependenceChecks(ExampleIndependenceSetting):
    """The guard's part of the JAX engine's `GradientTrackingMixin`: the setting, and
    the check before the first tracked step (the mixin's `fit` says whether one is
    wanted, by an `IndependenceGuard`; its train function calls
    `_check_independence_once`)."""

    def _check_independence_once(self, state: Any, data: Any) -> None:
        """Runs the example-independence guard on the first tracked step's batch of a
        fit that wants it (`IndependenceGuard.wanted`), unless the model passed on
        batches of its signature (`checked_once`)."""
        guard = self.__dict__.get("_independence_guard")
        if guard is None or not guard.wanted:
            return
        guard.wanted = False
        # A train_step of the model's own may feed the model something other than
        # `x` (a GAN's latent samples): there the guard may not apply (docs/zoo.md).
        own_step = self._has_own_step()  # type: ignore[attr-defined]
        self._check_examples_independent(state, data, forward_may_not_apply=own_step)

    def _find_example_mixing(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> Mixing | None:
        """The guard on one batch at the variables' current values (`kgt.check`'s), not
        remembered."""
        state = (
            [v.value for v in self.trainable_variables],  # type: ignore[attr-defined]
            [v.value for v in self.non_trainable_variables],  # type: ignore[attr-defined]
            None,
            [v.value for v in self.metrics_variables],  # type: ignore[attr-defined]
        )
        return find_example_mixing(self, state, x, y, sample_weight)

    def _check_examples_independent(
        self, state: Any, data: Any, forward_may_not_apply: bool = False
    ) -> None:
        """Runs the example-independence guard on one batch (without example ids) at the
        variables' values in `state`, once per model, compiled loss and batch signature
        (`checked_once`); raises its refusal, or remembers that the model passed
        (`_examples_independent`).

        Args:
            state: The step's state (trainable and non-trainable values first).
            data: The batch, `(x, y, sample_weight)` packed as Keras packs it.
            forward_may_not_apply: Whether a failure of the model's forward pass on
                `x` means the guard does not apply (it is skipped) rather than an error.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        checked_once(
            self,
            (x, y, sample_weight),
            lambda: find_example_mixing(self, state, x, y, sample_weight),
            forward_may_not_apply,
        )


def find_example_mixing(
    model: Any, state: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> Mixing | None:
    """Runs the guard on one batch: `Mixing` where it fails, None where it holds
    (or where a batch of one example leaves nothing to compare).

    Args:
        model: A built Keras model.
        state: The step's state; its first two entries are the values of
            `model.trainable_variables` and `model.non_trainable_variables`.
        x: The batch's inputs (without example ids).
        y: Its targets; with a compiled loss, the per-example losses are compared too.
        sample_weight: Its sample weights, if any.
    """

    # The metrics' values too: a compiled loss of several outputs updates a metric per
    # output, and Keras' fit holds their values in the state, not the variables.
    values = (state[0], state[1], state[3])
    # One program for both passes (eager JAX would compile each operation on its own,
    # and hold them all).
    compiled = jax.jit(lambda values, *batch: forward(model, values, *batch))

    def passes(batch: tuple[Any, ...], variant: tuple[Any, ...]) -> Any:
        return as_numpy(compiled(values, *batch)), as_numpy(compiled(values, *variant))

    return find_mixing(x, y, sample_weight, passes)


def forward(model: Any, values: Any, x: Any, y: Any, sample_weight: Any) -> dict[str, Any]:
    """`{what: (B, ...) values}`: the outputs and, with a compiled loss and targets,
    the per-example sums of the weighted loss values Keras reduces; `values` those of
    the model's trainable, non-trainable and metrics variables."""
    mapping = [
        *zip(model.trainable_variables, values[0]),
        *zip(model.non_trainable_variables, values[1]),
        *zip(model.metrics_variables, values[2]),
    ]
    with keras.StatelessScope(state_mapping=mapping), recording_losses() as recorder:
        y_pred = model(x, training=False)
        if y is not None:
            compute_loss(model, x, y, y_pred, sample_weight, training=False)
    return compared_values(y_pred, recorder.records)


def as_numpy(found: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: on_host(value) for name, value in found.items()}
