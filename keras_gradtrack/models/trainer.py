"""`GradientTrackingMixin`: per-example gradient tracking for any `keras.Model` class."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import utils as data_adapter_utils  # public: pack_x_y_sample_weight, unpack_...

from keras_gradtrack._keras_seam import loss_module
from keras_gradtrack.engine import data as batch_data
from keras_gradtrack.engine import (
    distribute,
    executions,
    preflight,
    private_training,
    tracking,
)
from keras_gradtrack.engine.batch_normalization_tracking import BatchNormalizationTracking
from keras_gradtrack.engine.batchless import with_unknown_batch_size
from keras_gradtrack.engine.example_independence import (
    ExampleIndependenceSetting,
    Mixing,
    checked_once,
)
from keras_gradtrack.engine.independence import (
    IndependenceGuard,
    find_example_mixing,
    first_batch,
    subscribes_to_gradients,
)
from keras_gradtrack.engine.plan import Plan, build_plan
from keras_gradtrack.engine.private_model import PrivateTraining
from keras_gradtrack.engine.schedule import PAYLOAD_KEY, TracksGradients, first_data_batch
from keras_gradtrack.engine.step import tracked_gradient
from keras_gradtrack.statistics import Statistic


class GradientTrackingMixin(
    PrivateTraining, ExampleIndependenceSetting, TracksGradients, BatchNormalizationTracking
):
    """Adds per-example gradient tracking to a `keras.Model` (TensorFlow backend).

    Put it before the Keras class: `class M(GradientTrackingMixin, keras.Model)`.
    Models with BatchNormalization in training mode opt in with
    `track_batch_normalization` (see `BatchNormalizationTracking`).
    Its `train_step` is Keras' own, with `tape.gradient` replaced by
    `self.tracked_gradient`; on the steps a gradient callback
    (`HDF5GradientLogger`) asks for, that same backward pass also yields the
    per-example statistics. A model with its own `train_step` keeps it: it
    runs on every step, and calls `self.tracked_gradient(tape, loss,
    variables)` where it would call `tape.gradient` (on a tracked step that
    does not, the step raises before any weight changes). For layers whose
    rule builds per-example gradients, the batch gradient is their sum: equal
    up to float32 rounding.

    After `make_private(...)`, every step is a DP-SGD step (clipped per-example
    gradients plus noise, from the same backward pass; `docs/privacy.md`).

    When `x` is a dict holding `"example_id"`, the ids are removed before the
    model is called (if exactly one other entry remains, its value is the
    model's input) and are logged with every row.

    Example:

    ```python
    import keras, keras_gradtrack as kgt

    class Classifier(kgt.GradientTrackingMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(32, activation="relu")
            self.out = keras.layers.Dense(10)

        def call(self, x):
            return self.out(self.hidden(x))
    ```
    """

    def _started_private_phase(self) -> None:
        settings = self.privacy_settings
        if settings is not None and settings.adaptive_clip is not None:
            # The bound C_t, updated by every step.
            self.__dict__["_adaptive_clip_bound"] = tf.Variable(
                settings.sensitivity, trainable=False, dtype=tf.float32
            )

    def _build_tracking_plan(self) -> Plan:
        return build_plan(self)

    def gradient_tracking_summary(
        self, print_fn: Callable[[str], Any] | None = None, *, x: Any = None
    ) -> str:
        """Prints (and returns) which path computes each layer's per-example gradients.

        Works before any step (`keras_gradtrack.check` traces the forward pass once
        on symbolic inputs). `path` is the layer's rule, `fallback` (the exact
        per-layer Jacobian, slower) or `refused` (what a tracked step would refuse,
        with the error below the table). `form` says whether the rule builds the
        layer's per-example gradients (`materialized`: the batch gradient of the
        layer is then their sum, and the backward pass skips it) or computes the
        statistics without them (`direct`); after a tracked step, the forms it
        took. `note` says why a layer has no rule, or how it is called.

        Args:
            print_fn: Called with the text (default `print`).
            x: Optional inputs of the model's shapes, for a subclassed model whose
                input shapes Keras does not know.

        Example:

        ```python
        model.gradient_tracking_summary()
        # column  layer   class  params  path        form    note
        # ------  ------  -----  ------  ----------  ------  ----
        # 0       hidden  Dense  8256    rule:dense  direct
        ```
        """
        report = preflight.check(self, x, self.gradient_tracking.forms, None, None)
        text = str(report)
        (print_fn or print)(text)
        return text

    def tracked_gradient(
        self,
        tape: tf.GradientTape,
        loss: Any,
        sources: Sequence[Any],
        *,
        per_example_loss: Any = None,
    ) -> list[Any]:
        """`tape.gradient(loss, sources)`, which on a tracked step also computes the statistics.

        Call it in a `train_step` of your own in place of `tape.gradient`. The
        per-example losses `l_i` come from the Keras losses the step computed
        (`self.compute_loss`, or a `keras.losses.Loss` called on the batch), or
        from `per_example_loss`, the `(B,)` losses that `loss` averages or sums.
        The statistics cover the layers whose variables are in `sources` (the
        per-layer columns of other layers are NaN). Call it once per step; for a
        second gradient in the same step (a GAN's other network) use
        `tape.gradient`.

        Args:
            tape: The tape that recorded the forward pass and the loss.
            loss: The (scaled) loss the optimizer minimizes.
            sources: The variables to differentiate, as for `tape.gradient`.
            per_example_loss: Optional `(B,)` per-example losses of the batch.

        Returns:
            The gradients, as `tape.gradient(loss, sources)` returns them.

        Example:

        ```python
        class VAE(kgt.GradientTrackingMixin, keras.Model):
            def train_step(self, x):
                with tf.GradientTape() as tape:
                    reconstruction, kl = self(x)
                    per_example = reconstruction + kl          # (B,)
                    loss = tf.reduce_mean(per_example)
                grads = self.tracked_gradient(
                    tape, loss, self.trainable_weights, per_example_loss=per_example)
                self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
                return {"loss": loss}
        ```
        """
        context = tracking.active(self)
        if context is None:
            return tape.gradient(loss, sources)
        if not context.recording:
            raise ValueError(
                "`tracked_gradient` was called twice in one step: the statistics are "
                "those of one gradient. Use `tape.gradient` for the other one."
            )
        return tracked_gradient(context, tape, loss, sources, per_example_loss)

    def _gradient_statistics(
        self, x: Any, y: Any, sample_weight: Any, statistics: list[Statistic]
    ) -> dict[str, np.ndarray]:
        key = tuple(statistic.name for statistic in statistics)
        functions = self.__dict__.setdefault("_gradient_statistics_functions", {})
        if key not in functions:

            def compute(data: Any) -> Any:
                data = with_unknown_batch_size(data)
                x, y, sample_weight, ids = batch_data.unpack_batch(data)
                with self._tracking(data, statistics, ids) as context:
                    with tf.GradientTape() as tape:
                        _, loss = self._forward_and_loss(tape, x, y, sample_weight)
                    self.tracked_gradient(tape, loss, self.trainable_weights)
                assert context.result is not None
                self.gradient_tracking.forms = dict(context.result.forms)
                payload = dict(context.result.payload)
                payload.pop("learning_rate")
                return payload

            functions[key] = tf.function(compute, reduce_retracing=True, autograph=False)
        if self.check_example_independence and not self.__dict__.get("_examples_independent"):
            model_x, _ = batch_data.split_example_ids(x, validate=False)
            self._check_examples_independent(model_x, y, sample_weight)
        data = data_adapter_utils.pack_x_y_sample_weight(x, y, sample_weight)
        payload = functions[key](data)
        return {name: np.asarray(value) for name, value in payload.items()}

    # -- Keras hooks --------------------------------------------------------

    def train_step(self, data: Any) -> Any:
        """Keras' train step, with `tracked_gradient` in place of `tape.gradient`."""
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred, loss = self._forward_and_loss(tape, x, y, sample_weight)
            self._loss_tracker.update_state(  # type: ignore[attr-defined]
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=batch_size_of(x),
            )
            if self.optimizer is not None:  # type: ignore[attr-defined]
                loss = self.optimizer.scale_loss(loss)  # type: ignore[attr-defined]
        trainable_weights = self.trainable_weights  # type: ignore[attr-defined]
        if trainable_weights:
            gradients = self.tracked_gradient(tape, loss, trainable_weights)
            self.optimizer.apply_gradients(zip(gradients, trainable_weights))  # type: ignore[attr-defined]
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)  # type: ignore[attr-defined]

    def _forward_and_loss(
        self, tape: tf.GradientTape, x: Any, y: Any, sample_weight: Any
    ) -> tuple[Any, Any]:
        """`(y_pred, loss)` of the batch, inside `tape` (Keras' forward and compiled loss)."""
        tracking.watch_inputs(self, tape, x)
        if self._call_has_training_arg:  # type: ignore[attr-defined]
            y_pred = self(x, training=True)  # type: ignore[operator]
        else:
            y_pred = self(x)  # type: ignore[operator]
        loss = self._compute_loss(  # type: ignore[attr-defined]
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        return y_pred, loss

    def test_step(self, data: Any) -> Any:
        return super().test_step(batch_data.strip_example_ids(data))  # type: ignore[misc]

    def predict_step(self, data: Any) -> Any:
        return super().predict_step(batch_data.strip_example_ids(data))  # type: ignore[misc]

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        # Keras converts numpy inputs before any step, and fails on string ids
        # with "Invalid dtype": say what ids must be first (and refuse a misspelt key).
        batch_data.check_example_ids(args[0] if args else kwargs.get("x"), self)
        callbacks = args[5] if len(args) > 5 else kwargs.get("callbacks")
        if self.privacy_settings is not None:
            if private_training.budget_steps_left(self) == 0:
                raise ValueError(private_training.budget_refusal(self))
            self.__dict__["_private_fit_data"] = private_training.fit_data(
                args[0] if args else kwargs.get("x"), kwargs
            )
        guard = self.__dict__["_independence_guard"] = IndependenceGuard(
            self.check_example_independence
            and (subscribes_to_gradients(callbacks) or self.privacy_settings is not None)
        )
        try:
            return super().fit(*args, **kwargs)  # type: ignore[misc]
        finally:
            guard.batch = None
            # However fit ends (an exception, an interrupt), its subscribers finish:
            # every tracked step they received reaches their files.
            self.gradient_tracking.end_fit()

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        # Checked once per model here (a loop of train_on_batch calls), once per fit in fit.
        self.__dict__["_independence_guard"] = IndependenceGuard(
            self.check_example_independence
            and (self.gradient_tracking.subscribed() or self.privacy_settings is not None)
            and not self.__dict__.get("_examples_independent")
        )
        return super().train_on_batch(*args, **kwargs)  # type: ignore[misc]

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        guard = self.__dict__.get("_independence_guard")
        if guard is not None and guard.wanted and guard.batch is None:
            # Keras resets `fit`'s iterator after this call, so a batch taken here is
            # seen again by the first step.
            guard.batch = data_batch if data_batch is not None else first_batch(iterator)
        fit_data = self.__dict__.pop("_private_fit_data", None)
        if fit_data is not None:
            batch = guard.batch if guard is not None and guard.batch is not None else None
            batch = batch if batch is not None else data_batch
            self._check_private_batches(
                fit_data, batch if batch is not None else first_batch(iterator)
            )
        if self._distribute_strategy is None or iterator is None:  # type: ignore[attr-defined]
            return super()._maybe_symbolic_build(iterator, data_batch)  # type: ignore[misc]
        # Keras averages a distributed batch across replicas to learn its shapes,
        # which fails for dict inputs under MultiWorkerMirroredStrategy; the
        # first replica's values carry the same shapes.
        strategy = self.distribute_strategy  # type: ignore[attr-defined]
        for _, _, data_iterator in iterator:
            batch = next(data_iterator)
            break
        data_batch = distribute.first_replica(batch, strategy)
        with strategy.scope():
            return self._symbolic_build(data_batch=data_batch)

    def _check_private_batches(self, fit_data: Any, batch: Any) -> None:
        """Checks `fit`'s data against the privacy settings (sampling rate, dataset
        size, batch size) before any step: `private_training.check_batches`."""
        if batch is None:
            return
        strategy = self.distribute_strategy  # type: ignore[attr-defined]
        leaf = tf.nest.flatten(distribute.first_replica(batch, strategy))[0]
        size = int(tf.shape(leaf)[0]) * int(strategy.num_replicas_in_sync)
        private_training.check_batches(self, fit_data[0], size, fit_data[1])

    def _layers_built(self) -> bool:
        return all(layer.built for layer in self._flatten_layers())  # type: ignore[attr-defined]

    def _build_before_tracing(self, iterator: Any) -> None:
        """Creates the optimizer's, the metrics' and the loss's variables before the
        first step is traced, from the shapes of the data `iterator` yields.

        Without a strategy Keras creates them inside the first trace of the step,
        and `tf.function` then traces the step a second time, without variable
        creation, and keeps both graphs; under a strategy Keras builds them first.
        Built here, the step is traced once, and no second graph of the tracked
        step is held (docs/performance.md). Only for a built model whose step is
        the built-in `train_step` (it hands the optimizer `trainable_weights`, as
        the optimizer is built here) and a `tf.data` iterator of dense tensors
        (`fit`'s, not `train_on_batch`'s), when the first step is due: after
        `on_train_begin`, so the callbacks' checks still come first.
        """
        spec = getattr(iterator, "element_spec", None)
        if (
            spec is None
            or not all(type(leaf) is tf.TensorSpec for leaf in tf.nest.flatten(spec))
            or self._distribute_strategy is not None  # type: ignore[attr-defined]
            or type(self).train_step is not GradientTrackingMixin.train_step
            or not self._layers_built()
        ):
            return
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.trainable_weights:  # type: ignore[attr-defined]
            # As `apply_gradients` builds it: these variables, under its name scope.
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(self.trainable_weights)  # type: ignore[attr-defined]
            optimizer.built = True
        # The metrics and the loss, as Keras builds them under a strategy.
        self._symbolic_build(data_batch=spec)

    def _symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        if data_batch is None and iterator is not None:
            data_batch = first_data_batch(iterator)
        if data_batch is not None:
            # Under a strategy Keras hands over a replica-averaged batch: ids
            # arrive as floats here, and only shapes matter.
            data_batch = batch_data.strip_example_ids(data_batch, validate=False)
        return super()._symbolic_build(data_batch=data_batch)  # type: ignore[misc]

    def _tracking(
        self, data: Any, statistics: Sequence[Statistic], ids: Any, requests: Sequence[Any] = ()
    ) -> tracking.TrackingContext:
        if not self._layers_built():
            # The taps are chosen before the forward pass, so a subclassed model
            # whose first step would build it is built here, from this batch.
            self._symbolic_build(data_batch=data)
        return tracking.TrackingContext(
            self, build_plan(self), statistics, ids, requests, batch=data
        )

    def _check_independence_once(self) -> None:
        """Runs the example-independence guard on the batch this fit put aside, once."""
        guard = self.__dict__.get("_independence_guard")
        if guard is None or guard.batch is None:
            return
        batch, guard.batch = guard.batch, None
        x, y, sample_weight, _ = batch_data.unpack_batch(
            distribute.first_replica(batch, self.distribute_strategy),  # type: ignore[attr-defined]
            validate=False,
        )
        # A train_step of the model's own may feed the model something other than
        # `x` (a GAN's latent samples): there the guard may not apply (docs/zoo.md).
        self._check_examples_independent(
            x, y, sample_weight, forward_may_not_apply=preflight.has_own_step(self)
        )

    def _find_example_mixing(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> Mixing | None:
        return find_example_mixing(self, x, y, sample_weight)

    def _check_examples_independent(
        self, x: Any, y: Any, sample_weight: Any, forward_may_not_apply: bool = False
    ) -> None:
        """Runs the example-independence guard on one batch; raises its refusal, or
        remembers that the model passed (`_examples_independent`).

        A model that passed on batches of the same structure, shapes past the batch
        axis and dtypes, compiled with the same loss, is not checked again (a later
        `fit`): the guard finds mixing in the model's operations and its loss, which
        its weights' values leave as they are.

        Args:
            x: The model's inputs (without example ids).
            y: The targets.
            sample_weight: The sample weights.
            forward_may_not_apply: Whether a failure of the model's forward pass on
                `x` means the guard does not apply (it is skipped) rather than an error.
        """
        checked_once(
            self,
            (x, y, sample_weight),
            lambda: find_example_mixing(self, x, y, sample_weight),
            forward_may_not_apply,
        )

    def _untracked_step(self, data: Any) -> Any:
        x, _, _, _ = batch_data.unpack_batch(data)
        logs = self.train_step(batch_data.strip_example_ids(data))
        # The batch size lets callbacks number examples on untracked steps too.
        (batch_size,) = distribute.all_reduce_sum([batch_size_of(x)])
        return {**logs, PAYLOAD_KEY: {"batch_size": batch_size}}

    def _tracked_step(
        self, data: Any, statistics: Sequence[Statistic], requests: Sequence[Any] = ()
    ) -> Any:
        data = with_unknown_batch_size(data)
        _, _, _, ids = batch_data.unpack_batch(data)
        with self._tracking(data, statistics, ids, requests) as context:
            logs = self.train_step(batch_data.strip_example_ids(data))
        if context.result is None:
            raise ValueError(
                f"The train_step of {type(self).__name__} did not call "
                "`self.tracked_gradient(tape, loss, variables)`, so this tracked step has "
                "no per-example statistics. Call it where the step calls "
                "`tape.gradient(loss, variables)` (it returns the same gradients); "
                "see GradientTrackingMixin.tracked_gradient."
            )
        self.gradient_tracking.forms = dict(context.result.forms)
        payload = context.result.payload
        if "dp_fraction_clipped" in payload:
            logs = {**logs, "dp_fraction_clipped": payload["dp_fraction_clipped"]}
        if "dp_l2_norm_clip" in payload:  # adaptive clipping: the step's bound
            logs = {**logs, "dp_l2_norm_clip": payload["dp_l2_norm_clip"]}
        return {**logs, PAYLOAD_KEY: payload}

    def make_train_function(self, force: bool = False) -> Any:
        if self.train_function is not None and not force:  # type: ignore[has-type]
            return self.train_function  # type: ignore[has-type]
        steps = int(getattr(self, "steps_per_execution", 1))
        if steps > 1:
            self.train_function = self._multi_step_train_function(steps)
            return self.train_function
        state = self.gradient_tracking
        strategy = self.distribute_strategy  # type: ignore[attr-defined]

        def compiled(step: Any) -> Any:
            def protected_step(data: Any) -> Any:
                return distribute.protect_from_replica_mean(step(data))

            return self._make_function(protected_step)  # type: ignore[attr-defined]

        untracked = compiled(self._untracked_step)
        tracked = self._tracked_functions(compiled)

        def train_function(iterator: Any) -> Any:
            due = state.due()
            private = self.privacy_settings is not None
            if not due and not private:
                outputs = distribute.unprotect(dict(untracked(iterator)), strategy)
                payload = outputs.pop(PAYLOAD_KEY)
                state.report(int(payload["batch_size"]), None, due)
                return outputs
            if private and not private_training.step_allowed(self):
                return self.get_metrics_result()  # type: ignore[attr-defined]
            self._check_independence_once()
            updates = private_training.UpdateCount(self) if private else None
            outputs = distribute.unprotect(dict(tracked(due)(iterator)), strategy)
            payload = outputs.pop(PAYLOAD_KEY)
            state.report(int(payload["batch_size"]), payload if due else None, due)
            if updates is not None:
                private_training.record_steps(self, updates.since())
            return outputs

        self.train_function = self._prepared_on_first_call(train_function)
        return self.train_function

    def _prepared_on_first_call(self, train_function: Callable[[Any], Any]) -> Any:
        """`train_function`, building what its traces need from the iterator first
        (`_build_before_tracing`) on its first call."""
        prepared = False

        def prepared_train_function(iterator: Any) -> Any:
            nonlocal prepared
            if not prepared:
                self._build_before_tracing(iterator)
                prepared = True
            return train_function(iterator)

        return prepared_train_function

    def _tracked_functions(self, compiled: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The compiled tracked step for the statistics and requests of `due`
        subscriptions (one compiled function per distinct set)."""
        state = self.gradient_tracking
        by_statistics: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}

        def tracked(due: Sequence[Any]) -> Any:
            statistics, requests = state.statistics(due), state.requests(due)
            key = (
                tuple(statistic.name for statistic in statistics),
                tuple(request.key for request in requests),
            )
            if key not in by_statistics:
                by_statistics[key] = compiled(
                    lambda data: self._tracked_step(data, statistics, requests)
                )
            return by_statistics[key]

        return tracked

    def _multi_step_train_function(self, steps: int) -> Any:
        """The train function for `steps_per_execution = steps > 1`: each call runs up
        to `steps` steps in one compiled loop and reports every step's rows.

        The call is tracked when a subscriber wants any of its steps (every step of
        it is then tracked: the rows of the steps asked for are those a call of one
        step would give); each subscriber receives the steps it asked for.
        """
        refusal = preflight.steps_per_execution_refusal(self)
        if refusal:
            raise ValueError(refusal)
        state = self.gradient_tracking
        jit_compile = bool(getattr(self, "jit_compile", False))

        def compiled(step: Any) -> Any:
            return executions.multi_step_function(step, steps, jit_compile)

        untracked = compiled(self._untracked_step)
        tracked = self._tracked_functions(compiled)

        def train_function(iterator: Any) -> Any:
            due = state.due_within(steps)
            if due:
                self._check_independence_once()
            execution = (tracked(due) if due else untracked)(iterator)
            for payload in execution.step_payloads():
                due_now = state.due()
                state.report(int(payload["batch_size"]), payload if due_now else None, due_now)
            return execution.logs

        return self._prepared_on_first_call(train_function)


def batch_size_of(x: Any) -> tf.Tensor:
    """The number of examples in the batch (int32 scalar, known at run time)."""
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]
