"""`GradientTrackingMixin` on the JAX backend: per-example gradient tracking in Keras' JAX trainer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras
import numpy as np

from keras_gradtrack.backends.jax.batchless import refuse_batchless_outputs_mixing_rows
from keras_gradtrack.backends.jax.coupled import coupled_path
from keras_gradtrack.backends.jax.distribution import (
    global_batch,
    on_host,
    refuse_untracked_distribution,
    step_out_shardings,
)
from keras_gradtrack.backends.jax.independence import ExampleIndependenceChecks
from keras_gradtrack.backends.jax.own_step import (
    keras_step,
    keras_tracked_step,
    own_tracked_step,
    tracked_value_and_grad,
)
from keras_gradtrack.backends.jax.plan import TrackedLayer, build_plan
from keras_gradtrack.backends.jax.private_model import JaxPrivateTraining
from keras_gradtrack.backends.jax.probes import Probes
from keras_gradtrack.backends.jax.step import Layouts, packed, unpacked
from keras_gradtrack.backends.ops.attribution import refuse_unknown_requests
from keras_gradtrack.backends.ops.mixin import ProbedTrackingMixin
from keras_gradtrack.backends.ops.step import Tracking, batch_size_of, split_example_ids
from keras_gradtrack.engine import private_training
from keras_gradtrack.engine.batch_normalization_tracking import BatchNormalizationTracking
from keras_gradtrack.engine.device_rows import DeviceRows
from keras_gradtrack.engine.schedule import PAYLOAD_KEY, TracksGradients
from keras_gradtrack.io.schema import BATCH_SIZE, EXAMPLE_ID, LEARNING_RATE
from keras_gradtrack.statistics import Statistic


class GradientTrackingMixin(
    ProbedTrackingMixin,
    JaxPrivateTraining,
    ExampleIndependenceChecks,
    TracksGradients,
    BatchNormalizationTracking,
):
    """Adds per-example gradient tracking to a `keras.Model` on the JAX backend.

    Put it before the Keras class: `class M(GradientTrackingMixin, keras.Model)`.
    Untracked steps are Keras' own JAX `train_step`. On the steps a gradient
    callback (`HDF5GradientLogger`) asks for, the step differentiates Keras'
    `compute_loss_and_updates` with respect to the trainable variables and to a
    zero probe on each tracked layer's (pre-activation) output, in one
    `jax.value_and_grad`: the optimizer receives the same gradients as in
    Keras' step, and the probes' gradients give the per-example statistics.

    A model with its own `train_step(self, state, data)` keeps it: it runs on
    every step, and calls `self.tracked_value_and_grad(fun, ...)` where it would
    call `jax.value_and_grad(fun, ...)` (on a tracked step that does not, the step
    raises before any weight changes).

    Before the first tracked step of a fit with a gradient callback (and in
    `gradient_statistics`), the example-independence guard runs, as on
    TensorFlow (`check_example_independence`).

    Under `keras.distribution` (`DataParallel`, `ModelParallel`; one process or
    several) the log is the one a single device writes (`distribution.py`).

    After `make_private(...)`, every step is a DP-SGD step (`private_step.py`).
    BatchNormalization in training is tracked with the model's opt-in,
    `track_batch_normalization` (`coupled.py`), in Keras' step or one's own.

    Example:

    ```python
    import os; os.environ["KERAS_BACKEND"] = "jax"
    import keras, keras_gradtrack as kgt

    model = kgt.GradientTrackingModel(inputs, outputs)    # this class on JAX
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[kgt.HDF5GradientLogger("run.h5")])
    ```
    """

    def tracked_value_and_grad(
        self, fun: Callable[..., Any], argnums: int = 0, has_aux: bool = False
    ) -> Callable[..., Any]:
        """`jax.value_and_grad(fun, argnums, has_aux)` for a `train_step` of your own.

        Call it where your `train_step(self, state, data)` calls
        `jax.value_and_grad`: it returns the same function. On the steps a gradient
        callback asks for, that function differentiates `fun` with respect to its
        first argument (the values of `self.trainable_variables`, `state[0]`) and
        to zero probes on the tracked layers' outputs and on the values each Keras
        loss in `fun` reduces, in the same one backward pass: it returns the same
        value and gradients, and the step's statistics join the logs your step
        returns. The per-example losses `l_i` are those of the Keras losses `fun`
        computes (the compiled loss through `compute_loss` or
        `compute_loss_and_updates`, or any `keras.losses.Loss`); other terms of
        the loss (weight penalties) enter the batch gradient `G` only.

        Args:
            fun: The function to differentiate; its first argument is the list of
                trainable values.
            argnums: Must be 0 on tracked steps (as Keras' own step uses it).
            has_aux: As in `jax.value_and_grad`: `fun` returns `(loss, aux)`.

        Returns:
            A function of `fun`'s arguments returning `(value, grads)` (with
            `has_aux`, `((loss, aux), grads)`), as `jax.value_and_grad` does.

        Example:

        ```python
        class MyModel(kgt.GradientTrackingModel):
            def train_step(self, state, data):
                trainable, non_trainable, optimizer_vars, metrics_vars = state
                x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
                grad_fn = self.tracked_value_and_grad(self.compute_loss_and_updates, has_aux=True)
                (loss, aux), grads = grad_fn(
                    trainable, non_trainable, metrics_vars, x, y, sample_weight,
                    training=True, optimizer_variables=optimizer_vars,
                )
                ...   # stateless_apply, metrics, as in Keras' train_step
        ```
        """
        return tracked_value_and_grad(self, fun, argnums, has_aux)

    def _build_tracking_plan(self) -> list[TrackedLayer]:
        return build_plan(self)

    def _layer_path(self, tracked: TrackedLayer) -> str:
        """The layer's path, through BatchNormalization in training where coupled."""
        return coupled_path(self, tracked)

    def _gradient_statistics(
        self, x: Any, y: Any, sample_weight: Any, statistics: list[Statistic]
    ) -> dict[str, np.ndarray]:
        self._refuse_untrackable(statistics, ())
        data, ids = split_example_ids(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))
        data, ids = global_batch(data), global_batch(ids)
        optimizer = self.optimizer  # type: ignore[attr-defined]
        if not self.built or (optimizer is not None and not optimizer.built):  # type: ignore[attr-defined]
            self._symbolic_build(data_batch=data)
        state = tuple(
            self._get_jax_state(  # type: ignore[attr-defined]
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
            )
        )
        if self.check_example_independence and not self.__dict__.get("_examples_independent"):
            self._check_examples_independent(state, data)
        key = tuple(statistic.name for statistic in statistics)
        functions = self.__dict__.setdefault("_gradient_statistics_functions", {})
        if key not in functions:
            plan = build_plan(self)
            self._refuse_batchless_rows_mixing(plan, state, data)
            layouts = Layouts()

            def compute(state: Any, data: Any) -> Any:
                logs, _ = keras_tracked_step(self, Tracking(plan, statistics), state, data)
                vector, layout = packed(logs[PAYLOAD_KEY])
                layouts.record(data, layout)
                return vector

            functions[key] = (jax.jit(compute), layouts)
        compute, layouts = functions[key]
        payload = unpacked(on_host(compute(state, data)), layouts.of(data))
        payload.pop(LEARNING_RATE)
        payload[BATCH_SIZE] = np.asarray(
            batch_size_of(keras.utils.unpack_x_y_sample_weight(data)[0]), np.int32
        )
        if ids is not None:
            payload[EXAMPLE_ID] = on_host(ids).astype(np.int64)
        return {name: np.array(value) for name, value in payload.items()}

    # -- Keras hooks --------------------------------------------------------

    def train_step(self, state: Any, data: Any) -> Any:
        """Keras' `train_step`: a model's own step may call `super().train_step(state,
        data)`, and on its tracked steps the statistics come from that call. A class of
        the model's own after this mixin, with its own step, keeps it."""
        following = super().train_step  # type: ignore[misc]
        if getattr(following, "__func__", None) is not keras.Model.train_step:
            return following(state, data)
        return keras_step(self, state, data, following)

    def test_step(self, state: Any, data: Any) -> Any:
        return super().test_step(state, split_example_ids(data)[0])  # type: ignore[misc]

    def predict_step(self, state: Any, data: Any) -> Any:
        return super().predict_step(state, split_example_ids(data)[0])  # type: ignore[misc]

    def _compiled(self, step: Any, out_shardings: Any) -> Any:
        if not self.run_eagerly and self.jit_compile:  # type: ignore[attr-defined]
            return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
        return step

    def _refuse_untrackable(self, statistics: Sequence[Statistic], requests: Sequence[Any]) -> None:
        refuse_unknown_requests(requests)
        refuse_untracked_distribution()

    def _refuse_batchless_rows_mixing(
        self, plan: Sequence[TrackedLayer], state: Any, data: Any
    ) -> None:
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        probes = Probes([tracked.layer for tracked in plan])
        refuse_batchless_outputs_mixing_rows(self, probes, state, x, batch_size_of(x))

    def _restore_variables(self, state: Any) -> None:
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        self._jax_state = {
            "trainable_variables": trainable,
            "non_trainable_variables": non_trainable,
            "optimizer_variables": optimizer_variables,
            "metrics_variables": metrics_variables,
        }
        self.jax_state_sync()  # type: ignore[attr-defined]

    def make_train_function(self, force: bool = False) -> None:
        if self.train_function is not None and not force:
            return
        tracking = self.gradient_tracking
        # Under keras.distribution, the state keeps its shardings, as in Keras' trainer.
        out_shardings = step_out_shardings(self)
        untracked = self._compiled(self.train_step, out_shardings)
        tracked_by_statistics: dict[Any, Any] = {}

        def one_step(state: Any, batch: Any) -> Any:
            data, ids = split_example_ids(batch)
            batch_size = batch_size_of(keras.utils.unpack_x_y_sample_weight(data)[0])
            due = tracking.due()
            private = self.privacy_settings is not None
            if not due and not private:
                logs, state = untracked(state, data)
                tracking.report(batch_size, None, due)
                return logs, state
            if private and not private_training.step_allowed(self):
                return self.__dict__.get("_last_private_logs", {}), state  # the budget's end
            statistics, requests = tracking.statistics(due), tracking.requests(due)
            key = (
                tuple(s.name for s in statistics) + tuple(r.key for r in requests),
                private,
            )
            try:
                self._check_independence_once(state, data)
            except Exception:
                self._restore_variables(state)
                raise
            if key not in tracked_by_statistics:
                try:
                    self._refuse_untrackable(statistics, requests)
                    plan = build_plan(self)
                    self._refuse_batchless_rows_mixing(plan, state, data)
                except Exception:
                    # Keras moved the variables' values into `state` for the fit:
                    # the model keeps the weights it had before the refused step.
                    self._restore_variables(state)
                    raise

                layouts = Layouts()

                # A train_step of the model's own runs, calling tracked_value_and_grad.
                tracked_step = own_tracked_step if self._has_own_step() else keras_tracked_step
                step_tracking = Tracking(plan, statistics, requests)
                if private:
                    step_tracking = self._private_tracking(step_tracking)

                def step(state: Any, data: Any) -> Any:
                    logs, state = tracked_step(self, step_tracking, state, data)
                    logs = dict(logs)
                    vector, layout = packed(logs.pop(PAYLOAD_KEY))
                    layouts.record(data, layout)  # when traced
                    return {**logs, PAYLOAD_KEY: vector}, state

                compiled = self._compiled_with_private_state(step, out_shardings)
                tracked_by_statistics[key] = (compiled, layouts)
            compiled_step, layouts = tracked_by_statistics[key]
            iterations = self._private_iterations(state) if private else None
            try:
                logs, state = compiled_step(state, data)
            except Exception:
                if data not in layouts:
                    # Refused while tracing (a loss the engine cannot split into
                    # examples, say): nothing ran, the model keeps its weights.
                    self._restore_variables(state)
                raise
            logs = dict(logs)
            vector, layout = logs.pop(PAYLOAD_KEY), layouts.of(data)
            host = {BATCH_SIZE: np.asarray(batch_size, np.int32)}
            if ids is not None:
                host[EXAMPLE_ID] = on_host(ids).astype(np.int64)
            if jax.process_count() > 1:
                # Over several processes every one gathers the step's rows now (a
                # collective), though only the first writes them.
                vector = on_host(vector)
            # One transfer of the whole payload, when first read: it waits for the
            # step, so not before (a logger reads it with its block).
            payload = DeviceRows(lambda: unpacked(vector, layout), [n for n, _ in layout], host)
            tracking.report(batch_size, payload if due else None, due)
            if private:
                self._record_private_step(iterations, state)
                self.__dict__["_last_private_logs"] = logs
            return logs, state

        steps = int(self.steps_per_execution)  # type: ignore[attr-defined]

        def train_function(state: Any, iterator: Any) -> Any:
            # As Keras' JAX trainer runs `steps_per_execution` steps: one jitted step
            # after another, each tracked or not as the loggers ask for it.
            logs, state = one_step(state, next(iterator))
            try:
                for _ in range(steps - 1):
                    logs, state = one_step(state, next(iterator))
            except StopIteration:
                pass
            return logs, state

        self.train_function = train_function
