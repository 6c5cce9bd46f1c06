"""`GradientTrackingMixin` on the PyTorch backend: per-example tracking in Keras' torch trainer."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import torch
from keras import ops

from keras_gradtrack.backends.ops import private_step as shared_private
from keras_gradtrack.backends.ops import step as shared
from keras_gradtrack.backends.ops.attribution import refuse_unknown_requests
from keras_gradtrack.backends.ops.loss_scale import loss_scale_of, unscaled
from keras_gradtrack.backends.ops.mixin import ProbedTrackingMixin
from keras_gradtrack.backends.ops.payload import columns_and_payload
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.private_model import ProbedPrivateTraining
from keras_gradtrack.backends.ops.protocol import Backend
from keras_gradtrack.backends.ops.step import ProbedPass, Tracking
from keras_gradtrack.backends.torch.attribution import target_calls
from keras_gradtrack.backends.torch.batchless import find_batchless_calls
from keras_gradtrack.backends.torch.coupled import coupled_positions, layer_path, step_coupling
from keras_gradtrack.backends.torch.fallback import fallback_per_example
from keras_gradtrack.backends.torch.forward import ProbedForward, detached, recorded_losses
from keras_gradtrack.backends.torch.independence import ExampleIndependenceChecks
from keras_gradtrack.backends.torch.own_step import OWN_STEP_KEY, own_tracked_step
from keras_gradtrack.backends.torch.plan import build_plan
from keras_gradtrack.backends.torch.private_step import backend_step
from keras_gradtrack.backends.torch.probes import Probes
from keras_gradtrack.engine import private_training, reductions
from keras_gradtrack.engine.batch_normalization_tracking import BatchNormalizationTracking
from keras_gradtrack.engine.schedule import TracksGradients
from keras_gradtrack.io.schema import BATCH_SIZE, EXAMPLE_ID, LEARNING_RATE
from keras_gradtrack.statistics import Statistic

BACKEND = "PyTorch"
TORCH = Backend(fallback_per_example, target_calls)


class GradientTrackingMixin(
    ProbedTrackingMixin,
    ProbedPrivateTraining,
    ExampleIndependenceChecks,
    TracksGradients,
    BatchNormalizationTracking,
):
    """Adds per-example gradient tracking to a `keras.Model` on the PyTorch backend.

    Put it before the Keras class: `class M(GradientTrackingMixin, keras.Model)`.
    Untracked steps are Keras' own torch `train_step`. On the steps a gradient callback
    asks for, the step is Keras' with `loss.backward()` replaced by one
    `torch.autograd.grad` over the trainable weights and every tracked layer's
    (pre-activation) output (`probes.py`): the optimizer receives the same gradients,
    and the outputs' gradients give the per-example statistics through the rules the
    JAX engine runs too (`backends/ops/`). After `make_private(...)` every step is a
    DP-SGD step whose optimizer receives the clipped, noised sum from that same
    backward pass (`private_step.py`).

    Example (`KERAS_BACKEND=torch` set before Keras is imported):

    ```python
    class Classifier(kgt.GradientTrackingMixin, keras.Model):
        ...

    Classifier().fit(x, y, callbacks=[kgt.HDF5GradientLogger("run.h5")])
    ```
    """

    def _build_tracking_plan(self) -> list[TrackedLayer]:
        return build_plan(self)

    def _layer_path(self, tracked: TrackedLayer) -> str:
        """The layer's path, through BatchNormalization in training where coupled."""
        return layer_path(self, tracked)

    def _refuse_untrackable(self, statistics: Sequence[Statistic], requests: Sequence[Any]) -> None:
        refuse_unknown_requests(requests)

    def _execution_notes(self) -> list[str]:
        if not self.compiled or not self.jit_compile:  # type: ignore[attr-defined]
            return []
        return [
            "jit_compile=True: Keras' torch.compile runs the untracked steps; the tracked "
            "steps run eagerly (docs/torch.md, How a tracked step works)."
        ]

    # -- the tracked step ---------------------------------------------------

    def _probed_step(
        self, data: Any, tracking: Tracking, training_step: bool
    ) -> tuple[dict[str, Any], list[Any], Any, dict[str, Any]]:
        """Keras' torch step up to the update, with the probes: `(payload, gradients,
        y_pred, rows)`, the gradients those `loss.backward()` would leave on the weights
        (a private model's training step: the private gradients, and their values for
        the logs in `rows`). On a training step the loss tracker counts the loss and
        the optimizer scales it, as Keras' step does."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        forward = ProbedForward.of(tracking, x)
        with forward.installed(self):
            if self._call_has_training_arg:
                y_pred = self(forward.x, training=True)
            else:
                y_pred = self(forward.x)
        self.zero_grad()
        # Several outputs, loss weights or a `compute_loss` of one's own: the losses'
        # reductions recorded, their values differentiated beside the outputs.
        own_loss = type(self).compute_loss is not keras.Model.compute_loss
        recording = own_loss or not shared.one_loss_of_one_output(self, data)
        with recorded_losses(recording) as forward.recorder:
            loss = self._compute_loss(
                x=forward.x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
        scale = None
        if training_step:
            self._loss_tracker.update_state(loss, sample_weight=forward.batch)
            if self.optimizer is not None:
                # `s`: a LossScaleOptimizer's dynamic scale, or a `loss_scale_factor`.
                scale = loss_scale_of([self.optimizer.scale_loss(1.0)])
                loss = self.optimizer.scale_loss(loss)
        forward.targets = (y, y_pred, sample_weight)
        payload, gradients, rows = self._differentiated(forward, loss, scale, training_step)
        return payload, gradients, y_pred, rows

    def _differentiated(
        self, forward: ProbedForward, loss: Any, scale: Any, training_step: bool
    ) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        """The tracked step's one backward pass: `(payload, gradients, rows)`.

        Args:
            forward: What the step's forward pass left (probes, watched inputs, the
                recorded losses or the compiled loss's targets).
            loss: The loss, times the loss scale `scale` (None: not scaled).
            training_step: Whether the step trains (a private model's gradients are
                then the private ones, with their values for the logs in `rows`).
        """
        recorder, tracking, batch = forward.recorder, forward.tracking, forward.batch
        records = [] if recorder is None else [record.values for record in recorder.records]
        variables = self.trainable_variables
        marked = [*forward.probes.probed, *forward.inputs, *records]
        # Through BatchNormalization in training (opted in): the layers it couples.
        coupled = coupled_positions(self, tracking.plan, forward.mixing)
        # A private step with nothing to log needs no batch gradient `G` (its update
        # is the clipped sums' and the noise): the backward pass then computes none of
        # the weights' gradients (a product per Dense layer, a filter gradient per
        # convolution), as the compilers of the other backends leave them out.
        private_only = (
            training_step
            and self.privacy_settings is not None
            and not tracking.statistics
            and not tracking.requests
            and not coupled
        )
        differentiated = marked if private_only else [v.value for v in variables] + marked
        grads = torch.autograd.grad(
            loss, differentiated, allow_unused=True, retain_graph=bool(coupled)
        )
        weight_grads = [None] * len(variables) if private_only else list(grads[: len(variables)])
        with torch.no_grad():
            # The statistics are the unscaled loss's (the optimizer unscales its own).
            marked_grads = unscaled(
                [
                    torch.zeros_like(tensor) if grad is None else grad
                    for tensor, grad in zip(marked, grads[len(grads) - len(marked) :])
                ],
                scale,
            )
            probe_grads = marked_grads[: len(forward.probes.probed)]
            if recorder is None:
                losses, factor = shared.per_example_losses(self, *forward.targets)
            else:
                factor = shared.recorded_loss_factor(recorder, batch)
                loss_grads = marked_grads[len(marked) - len(records) :]
                losses = reductions.per_example_shares(recorder.records, loss_grads) / factor
            inputs_end = len(forward.probes.probed) + len(forward.inputs)
            batch_grads = None  # none computed: the columns then hold no ||G^(k)||^2
            if not private_only:
                zero_filled = [
                    torch.zeros_like(v.value) if g is None else g
                    for v, g in zip(variables, weight_grads)
                ]
                batch_grads = unscaled(zero_filled, scale)
            probed = ProbedPass(
                calls=[(index, kwargs) for index, _, kwargs in forward.probes.calls],
                inputs=[detached(inputs) for _, inputs, _ in forward.probes.calls],
                probe_grads=probe_grads,
                trainable=[v.value.detach() for v in variables],
                non_trainable=[v.value.detach() for v in self.non_trainable_variables],
                grads=batch_grads,
                fallback=fallback_per_example,
                input_grads=marked_grads[len(forward.probes.probed) : inputs_end],
            )

            def graph_losses() -> Any:
                """`l` on the step's graph: each example's share of the recorded
                losses (their `dL/dv` held fixed), or the compiled loss's."""
                if recorder is None:
                    return shared.per_example_losses(self, *forward.targets)[0]
                shares = [grad.detach() for grad in loss_grads]
                return reductions.per_example_shares(recorder.records, shares) / factor

            coupling = step_coupling(
                self, tracking.plan, coupled, forward.mixing, graph_losses, probed.grads
            )
            # Without penalties or added losses the loss is `c sum_i l_i` exactly.
            exact_factor = factor if not self.losses else None
            columns, payload = columns_and_payload(
                self, tracking, probed, losses, factor, exact_factor, coupling, TORCH
            )
            if self.optimizer is not None:
                payload[LEARNING_RATE] = ops.convert_to_tensor(
                    self.optimizer.learning_rate, "float32"
                )
            # Copies: a tensor of a variable's (the adaptive bound) changes with it.
            payload = {k: v.detach().cpu().numpy().copy() for k, v in payload.items()}
            rows: dict[str, Any] = {}
            if training_step and self.privacy_settings is not None:
                step = backend_step(self, probed)
                arguments = (self, tracking.plan, probed, columns, factor, scale)
                weight_grads, rows = shared_private.private_gradients(step, *arguments)
                # The private step's own values take their columns' place (the step's bound).
                payload.update(
                    {k: np.asarray(v, np.float32) for k, v in rows.items() if k in payload}
                )
        return payload, weight_grads, rows

    def tracked_backward(self, loss: Any) -> None:
        """`loss.backward()` for a `train_step` of one's own: call it where the step calls
        `loss.backward()`. On an untracked step it is `loss.backward()`; on a tracked
        step the same gradients are left on the trainable variables (`v.value.grad`;
        a private model's: the clipped, noised ones) and the step's per-example
        statistics are computed from the same backward pass (`own_step.py`).

        Example:

        ```python
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.tracked_backward(loss)  # was: loss.backward()
            weights = self.trainable_weights[:]
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights], weights)
            ...
        ```
        """
        own = self.__dict__.get(OWN_STEP_KEY)
        if own is None:
            loss.backward()
            return
        if own.payload is not None:
            raise ValueError(
                "`tracked_backward` ran twice in one tracked step (or after "
                "`super().train_step(data)`); the step's statistics come from one "
                "differentiation of the loss."
            )
        own.payload, gradients, own.rows = self._differentiated(
            own, loss, loss_scale_of(own.scales), training_step=True
        )
        for variable, gradient in zip(self.trainable_variables, gradients):
            variable.value.grad = None if gradient is None else gradient.detach()

    def train_step(self, data: Any) -> Any:
        """Keras' torch `train_step`; reached by a model's own step through
        `super().train_step(data)` on a tracked step, the same step with its backward
        pass `tracked_backward`."""
        if self.__dict__.get(OWN_STEP_KEY) is None:
            return super().train_step(data)  # type: ignore[misc]
        return self._keras_tracked_step(data)

    def _keras_tracked_step(self, data: Any) -> Any:
        """Keras' torch `train_step` itself, `loss.backward()` its `tracked_backward`
        (tests/torch_backend/test_torch_own_train_step.py compares the two)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        # Compute predictions
        if self._call_has_training_arg:
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)

        # Call torch.nn.Module.zero_grad() to clear the leftover gradients
        # for the weights from the previous train step.
        self.zero_grad()

        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        self._loss_tracker.update_state(
            loss,
            sample_weight=next(i for i in keras.tree.flatten(x) if i is not None).shape[0],
        )
        if self.optimizer is not None:
            loss = self.optimizer.scale_loss(loss)

        # Compute gradients
        if self.trainable_weights:
            # Call torch.Tensor.backward() on the loss to compute gradients
            # for the weights.
            self.tracked_backward(loss)

            trainable_weights = self.trainable_weights[:]
            gradients = [v.value.grad for v in trainable_weights]

            # Update weights
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)

        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _tracked_train_step(self, data: Any, tracking: Tracking) -> tuple[Any, dict[str, Any]]:
        """Keras' torch `train_step`, its backward pass the probed one: `(logs, payload)`
        (a model's own `train_step`: `own_tracked_step`)."""
        if self._has_own_step():
            return own_tracked_step(self, data, tracking)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        payload, gradients, y_pred, rows = self._probed_step(data, tracking, training_step=True)
        trainable_weights = self.trainable_weights[:]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return {**logs, **rows}, payload

    def _statistics_tracking(self, data: Any, statistics: Sequence[Statistic]) -> Tracking:
        """`_tracking` for `gradient_statistics`, kept per statistics, trainable variables
        and shapes of the inputs (the search for batchless calls runs the model twice)."""
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        key = (
            tuple(statistic.name for statistic in statistics),
            tuple(id(variable) for variable in self.trainable_variables),
            tuple((tuple(t.shape), str(t.dtype)) for t in keras.tree.flatten(x)),
        )
        kept = self.__dict__.setdefault("_statistics_trackings", {})
        if key not in kept:
            kept[key] = self._tracking(data, statistics)
        return kept[key]

    def _tracking(
        self, data: Any, statistics: Sequence[Statistic], requests: Sequence[Any] = ()
    ) -> Tracking:
        """What the tracked steps of these statistics (and attribution requests) compute:
        the plan, and the calls that do not follow the batch (read from this batch's
        inputs)."""
        plan = build_plan(self)
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        probes = Probes([tracked.layer for tracked in plan])
        batchless = find_batchless_calls(self, probes, x)
        return Tracking(plan, statistics, requests, batchless=batchless)

    # -- Keras hooks --------------------------------------------------------

    def test_step(self, data: Any) -> Any:
        return super().test_step(shared.split_example_ids(data)[0])  # type: ignore[misc]

    def predict_step(self, data: Any) -> Any:
        return super().predict_step(shared.split_example_ids(data)[0])  # type: ignore[misc]

    def make_train_function(self, force: bool = False) -> Any:
        if self.train_function is not None and not force:
            return self.train_function
        super().make_train_function(force)  # type: ignore[misc]
        untracked = self.train_function
        tracking = self.gradient_tracking
        plans: dict[Any, Tracking] = {}

        def train_function(data: Any) -> Any:
            batch, ids = shared.split_example_ids(data[0])
            batch_size = shared.batch_size_of(keras.utils.unpack_x_y_sample_weight(batch)[0])
            due = tracking.due()
            private = self.privacy_settings is not None
            if not due and not private:
                logs = untracked([batch])
                tracking.report(batch_size, None, due)
                return logs
            if private and not private_training.step_allowed(self):
                return self.__dict__.get("_last_private_logs", {})  # the budget's end
            statistics, requests = tracking.statistics(due), tracking.requests(due)
            key = (tuple(s.name for s in statistics), tuple(r.key for r in requests), private)
            self._check_independence_once(batch)
            if key not in plans:
                self._refuse_untrackable(statistics, requests)
                plans[key] = self._tracking(batch, statistics, requests)
            updates = private_training.UpdateCount(self) if private else None
            logs, payload = self._tracked_train_step(batch, plans[key])
            if updates is not None:
                private_training.record_steps(self, updates.since())
                self.__dict__["_last_private_logs"] = logs
            payload[BATCH_SIZE] = np.asarray(batch_size, np.int32)
            if ids is not None:
                payload[EXAMPLE_ID] = np.asarray(ids).astype(np.int64)
            tracking.report(batch_size, payload if due else None, due)
            return logs

        self.train_function = train_function
        return train_function

    def _gradient_statistics(
        self, x: Any, y: Any, sample_weight: Any, statistics: list[Statistic]
    ) -> dict[str, np.ndarray]:
        self._refuse_untrackable(statistics, ())
        data, ids = shared.split_example_ids(
            keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, y, sample_weight = (
            keras.tree.map_structure(ops.convert_to_tensor, value) if value is not None else None
            for value in (x, y, sample_weight)
        )
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        if not self.built or (self.optimizer is not None and not self.optimizer.built):
            self._symbolic_build(data_batch=data)
        if self.check_example_independence and not self.__dict__.get("_examples_independent"):
            self._check_examples_independent(data)
        # What the step would assign (a dropout's seed, metrics) stays in the scope.
        # (The trainable values are the variables' own: the backward pass reaches them,
        # and the weight penalties read them in the scope.)
        mapping = [(v, v.value) for v in self.trainable_variables] + [
            (v, v.value.detach().clone())
            for v in [*self.non_trainable_variables, *self.metrics_variables]
        ]
        with keras.StatelessScope(state_mapping=mapping):
            payload, _, _, _ = self._probed_step(
                data, self._statistics_tracking(data, statistics), training_step=False
            )
        payload.pop(LEARNING_RATE, None)
        payload[BATCH_SIZE] = np.asarray(shared.batch_size_of(x), np.int32)
        if ids is not None:
            payload[EXAMPLE_ID] = np.asarray(ids).astype(np.int64)
        return {name: np.array(value) for name, value in payload.items()}
