"""Which steps are tracked: the model's step counter and its loggers' subscriptions.

The model owns the count of its training steps and the decision to track one.
A logger subscribes with its statistics and cadence, and receives a
`StepReport` after every step of the fits it subscribed for; every replica and
every worker takes the same decision from the same counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from keras_gradtrack.engine.device_rows import DeviceRows
from keras_gradtrack.statistics import Statistic, resolve

# The key under which a compiled step returns its gradient payload.
PAYLOAD_KEY = "__gradtrack__"


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What a subscriber receives after each training step.

    Attributes:
        step: The step's index since the subscription (0 for the first step).
        batch_size: Examples in the step (over all replicas).
        values: On steps the subscriber asked for, its statistics and the
            step's `example_id` (when the batch held ids), `learning_rate` and
            `batch_size`, as numpy arrays; None on other steps. A `DeviceRows`
            (JAX) copies them from the device when first read.
    """

    step: int
    batch_size: int
    values: Mapping[str, np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class Subscription:
    """A subscriber's request: statistics, cadence, and where the reports go.

    Attributes:
        statistics: The statistics it needs.
        every_n_steps: It asks for one step in every `every_n_steps`.
        first_step: The model's step count when it subscribed.
        consume: Receives the `StepReport` of every step.
        finish: Called once when the fit ends, however it ends (an exception
            or an interrupt included); None for nothing.
        requests: Per-example rows it needs beside the statistics (each
            `engine.requests.AttributionRequest` reports under its `key`).
    """

    statistics: tuple[Statistic, ...]
    every_n_steps: int
    first_step: int
    consume: Callable[[StepReport], None]
    finish: Callable[[], None] | None = None
    requests: tuple[Any, ...] = ()

    def wants(self, step: int) -> bool:
        return (step - self.first_step) % self.every_n_steps == 0


class GradientTrackingState:
    """The model's side of tracking: its step counter and subscriptions.

    Attributes:
        step: Training steps this model has run in `fit`.
        forms: Column name -> form of each layer in the last traced tracked step.
    """

    def __init__(self) -> None:
        self.step = 0
        self.forms: dict[str, str] = {}
        self._subscriptions: dict[Hashable, Subscription] = {}

    def subscribe(
        self,
        key: Hashable,
        statistics: Sequence[Statistic],
        every_n_steps: int,
        consume: Callable[[StepReport], None],
        finish: Callable[[], None] | None = None,
        requests: Sequence[Any] = (),
    ) -> None:
        """Starts reports to `consume` from the next step on (replacing `key`'s earlier one).

        A callback that subscribes declares `subscribes_to_gradients = True`, so
        that `fit` puts a batch aside for the example-independence guard, which
        runs before the first tracked step.
        """
        self._subscriptions[key] = Subscription(
            tuple(statistics), every_n_steps, self.step, consume, finish, tuple(requests)
        )

    def unsubscribe(self, key: Hashable) -> None:
        self._subscriptions.pop(key, None)

    def subscribed(self) -> bool:
        """Whether a subscriber asks for reports now."""
        return bool(self._subscriptions)

    def due(self) -> list[Subscription]:
        """The subscriptions that want the next step tracked."""
        return [s for s in self._subscriptions.values() if s.wants(self.step)]

    def due_within(self, steps: int) -> list[Subscription]:
        """The subscriptions that want any of the next `steps` steps tracked."""
        return [
            s
            for s in self._subscriptions.values()
            if any(s.wants(self.step + ahead) for ahead in range(steps))
        ]

    def statistics(self, subscriptions: Sequence[Subscription]) -> list[Statistic]:
        """The union of their statistics, by name, in subscription order."""
        union: dict[str, Statistic] = {}
        for subscription in subscriptions:
            for statistic in subscription.statistics:
                union.setdefault(statistic.name, statistic)
        return list(union.values())

    def requests(self, subscriptions: Sequence[Subscription]) -> list[Any]:
        """Their attribution requests, in subscription order."""
        return [request for s in subscriptions for request in s.requests]

    def report(self, batch_size: int, values: Mapping[str, Any] | None, due: Sequence[Any]) -> None:
        """Counts the step, then reports it to every subscriber (values to those due)."""
        step, self.step = self.step, self.step + 1
        arrays = values
        if values is not None and not isinstance(values, DeviceRows):
            arrays = {k: np.asarray(v) for k, v in values.items()}
        for subscription in list(self._subscriptions.values()):
            wanted = arrays if any(subscription is d for d in due) else None
            subscription.consume(StepReport(step - subscription.first_step, batch_size, wanted))

    def end_fit(self) -> None:
        """Ends every subscription, calling their `finish` (the fit is over)."""
        subscriptions, self._subscriptions = self._subscriptions, {}
        errors = []
        for subscription in subscriptions.values():
            if subscription.finish is not None:
                try:
                    subscription.finish()
                except Exception as error:  # every subscriber is finished
                    errors.append(error)
        if errors:
            raise errors[0]


def first_data_batch(iterator: Any) -> Any:
    """The first batch of a Keras epoch iterator, as `Trainer._symbolic_build` takes it
    (both engines' mixins strip its example ids before Keras builds from it)."""
    for _, _, data_or_iterator in iterator:
        if isinstance(data_or_iterator, (list, tuple)):
            return data_or_iterator[0]
        return next(data_or_iterator)
    return None


class TracksGradients:
    """What a tracking model has on every backend: its `GradientTrackingState`, its
    plan's columns and `gradient_statistics`. Each engine's mixin supplies
    `_build_tracking_plan` and `_gradient_statistics`."""

    def gradient_statistics(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        statistics: Sequence[str | Statistic] | None = None,
    ) -> dict[str, np.ndarray]:
        """Computes gradient statistics for one batch, without updating the weights.

        The same computation as a tracked `fit` step of the built-in
        `train_step` (same per-example losses, same batch gradient `G`), for use
        outside `fit`: the step's updated weights, optimizer state and metrics are
        dropped. The model must be compiled (the loss defines `l_i`).

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
        return self._gradient_statistics(x, y, sample_weight, resolve(statistics))

    def _gradient_statistics(
        self, x: Any, y: Any, sample_weight: Any, statistics: list[Statistic]
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @property
    def gradient_tracking(self) -> GradientTrackingState:
        """The model's step counter and its gradient callbacks' subscriptions."""
        state = self.__dict__.get("_gradient_tracking_state")
        if state is None:
            state = GradientTrackingState()
            self.__dict__["_gradient_tracking_state"] = state
        return state

    def gradient_tracking_plan(self) -> Any:
        """The tracked layers, in the column order of the per-layer statistics.

        Raises:
            ValueError: If the model is not built, or cannot be tracked (no trainable
                weights, a BatchNormalization layer that may train without
                `track_batch_normalization`, variables outside layers).
        """
        if not self.built:  # type: ignore[attr-defined]
            raise ValueError(
                f"Model {self.name!r} is not built yet; call it on a batch or `build()` "  # type: ignore[attr-defined]
                "it before asking for its tracking plan."
            )
        return self._build_tracking_plan()

    def _build_tracking_plan(self) -> Any:
        raise NotImplementedError

    @property
    def tracked_layer_names(self) -> list[str]:
        """Names of the per-layer statistic columns."""
        return [tracked.name for tracked in self.gradient_tracking_plan()]
