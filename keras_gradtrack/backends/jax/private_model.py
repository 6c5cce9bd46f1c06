"""Private training on the JAX backend: `fit`'s checks, and the step's state of its own.

The settings, the history, epsilon and saving are the shared `PrivateTraining`'s
(`engine/private_model.py`); the budget and the batch checks are the shared
`private_training`'s; the step is `private_step.py`'s. With adaptive clipping the
bound `C_t` is a non-trainable Keras variable of the model (not one of its weights,
as on TensorFlow); the compiled step takes its value with the step's state, reads
and updates it in a `keras.StatelessScope`, and returns `C_{t+1}`, which is assigned
to the variable (`_compiled_with_private_state`). The saved settings hold the bound
reached (`private_settings.config_of`), so a loaded model goes on from it.

Example:

```python
import os; os.environ["KERAS_BACKEND"] = "jax"
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=256 / len(x))
model.fit(x, y, batch_size=256, epochs=3)
model.epsilon(1e-5)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from keras_gradtrack.backends.jax.private_step import logical_iterations, private_gradients
from keras_gradtrack.backends.ops.private_model import BOUND_KEY, ProbedPrivateTraining
from keras_gradtrack.backends.ops.step import Tracking
from keras_gradtrack.engine import private_training


class JaxPrivateTraining(ProbedPrivateTraining):
    """`make_private` on JAX: one bound or bounds per group, adaptive clipping, the
    noise, logical batches, a loss scale, a model's own step, the history, the
    budget and the sampling checks, as on TensorFlow."""

    _compiled: Callable[[Any, Any], Any]  # the mixin's jit of a step

    def _private_step_variables(self) -> list[Any]:
        """The variables a private step updates besides Keras' state (the adaptive
        bound), none for another model."""
        settings = self.privacy_settings
        if settings is None or settings.adaptive_clip is None:
            return []
        return [self.__dict__[BOUND_KEY]]

    def _compiled_with_private_state(self, step: Any, out_shardings: Any) -> Any:
        """`step(state, data) -> (logs, state)` compiled; with variables of the private
        step's own (`_private_step_variables`), their values go into the compiled step,
        which runs `step` in a `keras.StatelessScope` mapping them and returns their
        new values, assigned after it (no wait for the step)."""
        variables = self._private_step_variables()
        if not variables:
            return self._compiled(step, out_shardings)

        def stateful(state: Any, data: Any, values: Any) -> Any:
            with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
                logs, state = step(state, data)
            return logs, state, [scope.get_current_value(v) for v in variables]

        shardings = None if out_shardings is None else (*out_shardings, None)
        compiled = self._compiled(stateful, shardings)

        def run(state: Any, data: Any) -> Any:
            logs, state, values = compiled(state, data, [v.value for v in variables])
            for variable, value in zip(variables, values):
                variable.assign(value)
            return logs, state

        return run

    def _private_iterations(self, state: Any) -> int | None:
        """The optimizer's logical iterations in `state` (read before the step donates
        it), with accumulation; None without."""
        return logical_iterations(self, state[2])

    def _record_private_step(self, iterations_before: int | None, state: Any) -> None:
        """Adds the step's optimizer updates to the current phase of the history: one,
        or with accumulation the change of the logical iterations."""
        updates = 1
        if iterations_before is not None:
            updates = int(logical_iterations(self, state[2]) or 0) - iterations_before
        private_training.record_steps(self, updates)

    def _private_tracking(self, tracking: Tracking) -> Tracking:
        """`tracking` for a tracked step (Keras' or the model's own) whose optimizer
        receives the private gradients."""
        return dataclasses.replace(tracking, private=private_gradients)
