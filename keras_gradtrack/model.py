"""`GradientTrackingMixin` and `GradientTrackingModel`: a `keras.Model` whose `fit`
also computes exact per-example gradient statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_gradtrack import statistics as statistics_module
from keras_gradtrack.engine import data as batch_data
from keras_gradtrack.engine import distribute
from keras_gradtrack.engine.plan import TrackedLayer, build_plan, format_summary
from keras_gradtrack.engine.step import PAYLOAD_KEY, tracked_train_step
from keras_gradtrack.rules.base import compiled_with_xla
from keras_gradtrack.statistics import Statistic


class GradientTrackingState:
    """What the compiled steps and the callbacks share on one model.

    Callbacks subscribe with the statistics they write and request the steps
    they want; the model computes the union of the subscribed statistics on a
    requested step and leaves the values in `latest`, where the callbacks read
    them in `on_train_batch_end`. Other steps run Keras' own, untracked step.
    """

    def __init__(self) -> None:
        self.subscriptions: dict[int, list[Statistic]] = {}
        self.requested = False
        self.latest: dict[str, Any] | None = None
        self.batch_size: Any = None
        # The plan of the last traced tracked step, with each layer's form.
        self.traced_plan: list[TrackedLayer] | None = None

    def statistics(self) -> list[Statistic]:
        """The union of the subscribed statistics, by name, in subscription order."""
        union: dict[str, Statistic] = {}
        for statistics in self.subscriptions.values():
            for statistic in statistics:
                union.setdefault(statistic.name, statistic)
        return list(union.values())


class GradientTrackingMixin:
    """Adds per-example gradient tracking to a `keras.Model` (TensorFlow backend).

    Put it before the Keras class: `class M(GradientTrackingMixin, keras.Model)`.
    The weight update is Keras' own (for layers whose rule builds per-example
    gradients, the batch gradient is their sum: equal up to float32 rounding).
    On the steps a gradient callback (`HDF5GradientLogger`) asks for, the same
    backward pass also yields the per-example statistics. Other steps run
    Keras' untracked step unchanged.

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

    @property
    def gradient_tracking(self) -> GradientTrackingState:
        """The state shared with the gradient callbacks."""
        state = self.__dict__.get("_gradient_tracking_state")
        if state is None:
            state = GradientTrackingState()
            self.__dict__["_gradient_tracking_state"] = state
        return state

    def gradient_tracking_plan(self) -> list[TrackedLayer]:
        """The tracked layers, in the column order of the per-layer statistics.

        Raises:
            ValueError: If the model cannot be tracked (no trainable weights, a
                BatchNormalization layer in training mode, variables outside
                layers). Call it on a built model.
        """
        if not self.built:
            raise ValueError(
                f"Model {self.name!r} is not built yet; call it on a batch or `build()` it "
                "before asking for its tracking plan."
            )
        return build_plan(self)

    @property
    def tracked_layer_names(self) -> list[str]:
        """Names of the per-layer statistic columns."""
        return [tracked.name for tracked in self.gradient_tracking_plan()]

    def gradient_tracking_summary(self, print_fn: Callable[[str], Any] | None = None) -> str:
        """Prints (and returns) which path computes each layer's per-example gradients.

        The `form` column says, once a tracked step has been traced, whether the
        rule builds the layer's per-example gradients (`materialized`: the batch
        gradient of the layer is then their sum, and the backward pass skips it)
        or computes the statistics without them (`direct`); `-` before the first
        tracked step, `jacobian` on the fallback path.

        Example:

        ```python
        model.gradient_tracking_summary()
        # column  layer   class  params  path        form
        # ------  ------  -----  ------  ----------  ------
        # 0       hidden  Dense  8256    rule:dense  direct
        ```
        """
        plan = self.gradient_tracking_plan()
        traced = self.gradient_tracking.traced_plan
        if traced is not None and [t.name for t in traced] == [t.name for t in plan]:
            plan = traced
        text = format_summary(plan)
        (print_fn or print)(text)
        return text

    def gradient_statistics(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        statistics: Sequence[str | Statistic] | None = None,
    ) -> dict[str, np.ndarray]:
        """Computes gradient statistics for one batch, without updating the weights.

        The same computation as a tracked `fit` step (same per-example losses,
        same batch gradient `G`), for use outside `fit`. The model must be
        compiled (the loss defines `l_i`).

        Args:
            x: Input batch (a dict with `"example_id"` is accepted).
            y: Targets.
            sample_weight: Optional per-example weights.
            statistics: Names or `Statistic` objects; defaults to the built-ins.

        Returns:
            A dict of numpy arrays: each statistic, plus `batch_size` (and
            `example_id` when `x` holds ids).

        Example:

        ```python
        stats = model.gradient_statistics(x[:128], y[:128])
        stats["cosine"]           # (128,) cosine of each example with the batch gradient
        stats["layer_grad_norm"]  # (128, L)
        ```
        """
        resolved = statistics_module.resolve(statistics)
        key = tuple(statistic.name for statistic in resolved)
        functions = self.__dict__.setdefault("_gradient_statistics_functions", {})
        if key not in functions:

            def compute(data: Any) -> Any:
                return self._tracked_train_step(data, resolved, apply_update=False)

            functions[key] = tf.function(compute, reduce_retracing=True, autograph=False)
        data = data_adapter_utils.pack_x_y_sample_weight(x, y, sample_weight)
        payload = functions[key](data)[PAYLOAD_KEY]
        return {name: np.asarray(value) for name, value in payload.items()}

    # -- Keras hooks --------------------------------------------------------

    def train_step(self, data: Any) -> Any:
        data = batch_data.strip_example_ids(data)
        logs = super().train_step(data)  # type: ignore[misc]
        # The batch size lets callbacks number examples on untracked steps too.
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        (batch_size,) = distribute.all_reduce_sum([batch_data.batch_size_of(x)])
        return {**logs, PAYLOAD_KEY: {"batch_size": batch_size}}

    def test_step(self, data: Any) -> Any:
        return super().test_step(batch_data.strip_example_ids(data))  # type: ignore[misc]

    def predict_step(self, data: Any) -> Any:
        return super().predict_step(batch_data.strip_example_ids(data))  # type: ignore[misc]

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        if self._distribute_strategy is None or iterator is None:  # type: ignore[attr-defined]
            return super()._maybe_symbolic_build(iterator, data_batch)  # type: ignore[misc]
        # Keras averages a distributed batch across replicas to learn its shapes,
        # which fails for dict inputs under MultiWorkerMirroredStrategy; the
        # first replica's values carry the same shapes.
        strategy = self.distribute_strategy  # type: ignore[attr-defined]
        for _, _, data_iterator in iterator:
            batch = next(data_iterator)
            break
        data_batch = tree.map_structure(
            lambda value: (
                strategy.experimental_local_results(value)[0]
                if isinstance(value, tf.distribute.DistributedValues)
                else value
            ),
            batch,
        )
        with strategy.scope():
            return self._symbolic_build(data_batch=data_batch)

    def _symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        if data_batch is None and iterator is not None:
            for _, _, data_or_iterator in iterator:
                if isinstance(data_or_iterator, (list, tuple)):
                    data_batch = data_or_iterator[0]
                else:
                    data_batch = next(data_or_iterator)
                break
        if data_batch is not None:
            # Under a strategy Keras hands over a replica-averaged batch: ids
            # arrive as floats here, and only shapes matter.
            data_batch = batch_data.strip_example_ids(data_batch, validate=False)
        return super()._symbolic_build(data_batch=data_batch)  # type: ignore[misc]

    def _tracked_train_step(
        self, data: Any, statistics: Sequence[Statistic], apply_update: bool = True
    ) -> Any:
        if not all(layer.built for layer in self._flatten_layers()):
            # The taps are chosen before the forward pass, so a subclassed model
            # whose first step would build it is built here, from this batch.
            self._symbolic_build(data_batch=data)
        plan = build_plan(self)
        with compiled_with_xla(bool(getattr(self, "jit_compile", False))):
            outputs = tracked_train_step(self, data, plan, statistics, apply_update=apply_update)
        self.gradient_tracking.traced_plan = plan
        return outputs

    def make_train_function(self, force: bool = False) -> Any:
        if self.train_function is not None and not force:  # type: ignore[has-type]
            return self.train_function  # type: ignore[has-type]
        state = self.gradient_tracking
        strategy = self.distribute_strategy  # type: ignore[attr-defined]

        def compiled(step: Any) -> Any:
            def protected_step(data: Any) -> Any:
                return distribute.protect_from_replica_mean(step(data))

            return self._make_function(protected_step)  # type: ignore[attr-defined]

        untracked = compiled(self.train_step)
        tracked_by_statistics: dict[tuple[str, ...], Any] = {}

        def train_function(iterator: Any) -> Any:
            state.latest = None
            if not state.requested:
                outputs = distribute.unprotect(dict(untracked(iterator)), strategy)
                state.batch_size = outputs.pop(PAYLOAD_KEY, {}).get("batch_size")
                return outputs
            state.requested = False
            statistics = state.statistics()
            key = tuple(statistic.name for statistic in statistics)
            if key not in tracked_by_statistics:
                tracked_by_statistics[key] = compiled(
                    lambda data: self._tracked_train_step(data, statistics)
                )
            outputs = distribute.unprotect(dict(tracked_by_statistics[key](iterator)), strategy)
            state.latest = outputs.pop(PAYLOAD_KEY)
            state.batch_size = state.latest["batch_size"]
            return outputs

        self.train_function = train_function
        return train_function


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingModel(GradientTrackingMixin, keras.Model):
    """A `keras.Model` with per-example gradient tracking.

    Use it exactly like `keras.Model`: functional (`GradientTrackingModel(inputs,
    outputs)`) or subclassed. It saves and loads with `model.save()` /
    `keras.models.load_model()`.

    Example:

    ```python
    import keras, keras_gradtrack as kgt

    inputs = keras.Input((784,), name="pixels")
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    model = kgt.GradientTrackingModel(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit({"pixels": x, "example_id": ids}, y,
              callbacks=[kgt.HDF5GradientLogger("run.h5")])
    ```
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Keras makes a `Model` subclass functional by rewriting its bases in
        # place, after which subclass-style construction of the same class
        # fails. A functional variant of the class keeps both styles working.
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = functional_variant(cls)
        return super().__new__(cls)


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class FunctionalGradientTrackingModel(GradientTrackingModel, Functional):
    """What `GradientTrackingModel(inputs, outputs)` builds: a functional model."""


FUNCTIONAL_VARIANTS: dict[type, type] = {GradientTrackingModel: FunctionalGradientTrackingModel}


def functional_variant(cls: type) -> type:
    """`cls` with `Functional` mixed in (same name and module, so saving finds `cls`)."""
    if cls not in FUNCTIONAL_VARIANTS:
        FUNCTIONAL_VARIANTS[cls] = type(
            cls.__name__,
            (cls, Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return FUNCTIONAL_VARIANTS[cls]


@keras.saving.register_keras_serializable(package="keras_gradtrack")
class GradientTrackingSequential(GradientTrackingMixin, keras.Sequential):
    """A `keras.Sequential` with per-example gradient tracking.

    Example:

    ```python
    model = kgt.GradientTrackingSequential([
        keras.Input((20,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])
    ```
    """


# A legacy `.h5` file names the model class by its bare `__name__`, where a
# `.keras` file uses the registered "keras_gradtrack>..." name: register the bare
# names too, so that `keras.models.load_model("model.h5")` finds these classes.
keras.saving.get_custom_objects().update(
    {
        cls.__name__: cls
        for cls in (
            GradientTrackingModel,
            FunctionalGradientTrackingModel,
            GradientTrackingSequential,
        )
    }
)
