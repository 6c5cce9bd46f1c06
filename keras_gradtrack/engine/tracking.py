"""The tracking context of one tracked step: what its forward pass records.

While a tracked step is traced, the model's `train_step` (the library's own or
the user's) runs inside a `TrackingContext`. The context taps every tracked
layer, records each Keras loss reduction and weight-regularization penalty and
the loss scale, until the step asks for its gradients with
`model.tracked_gradient(tape, loss, sources)`. That call ends the recording and
runs the backward phases (`engine.step`) in place of `tape.gradient`.
Outside a context, `tracked_gradient` is `tape.gradient`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import keras

from keras_gradtrack._patching import patched, patched_each
from keras_gradtrack.engine.batchless import BatchDependence
from keras_gradtrack.engine.coupled import coupling_recorder
from keras_gradtrack.engine.data import float_inputs
from keras_gradtrack.engine.losses import recording_losses
from keras_gradtrack.engine.plan import Plan
from keras_gradtrack.engine.reductions import LossRecorder
from keras_gradtrack.engine.taps import LayerTap, OpRange, graph_ops_recorded, installed
from keras_gradtrack.statistics import Statistic

_ACTIVE: contextvars.ContextVar[TrackingContext | None] = contextvars.ContextVar(
    "gradient_tracking_context", default=None
)


class RowRequest(Protocol):
    """Per-example rows asked of the step beside the statistics (the step's payload
    holds them under `key`); `engine.requests.AttributionRequest` is one."""

    key: str

    def rows(self, batch: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Penalty:
    """A weight-regularization penalty computed in the step (fresh copy on the tape)."""

    value: Any
    variable: Any
    graph_ops: range


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `tracked_gradient` leaves in the context: the statistics and each layer's form."""

    payload: dict[str, Any]
    forms: dict[str, str]


class TrackingContext:
    """Records the forward pass of one tracked step (see the module docstring).

    Args:
        model: The model whose step is traced.
        plan: Its tracking plan.
        statistics: The statistics to compute.
        example_ids: The batch's ids, or None.
        requests: Per-example rows asked for beside the statistics (products
            with targets' gradients, gradient sketches).
        batch: The step's data: layer calls on values that do not depend on
            them are broadcast to the batch (None: calls are taken as they come).
    """

    def __init__(
        self,
        model: Any,
        plan: Plan,
        statistics: Sequence[Statistic],
        example_ids: Any,
        requests: Sequence[RowRequest] = (),
        batch: Any = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.statistics = list(statistics)
        self.example_ids = example_ids
        self.requests = tuple(requests)
        self.batch = None if batch is None else BatchDependence(batch)
        # The one place the step's compilation is read: the rules see it as `LayerCall.xla`.
        self.xla = bool(getattr(model, "jit_compile", False))
        self.taps = [
            LayerTap(tracked.layer, tracked.rule, self.batch, self.xla) for tracked in plan
        ]
        self.losses = LossRecorder()
        self.penalties: list[Penalty] = []
        self.loss_scale: Any | None = None
        self.watched_inputs: list[Any] = []
        self.forward = OpRange()
        # BatchNormalization in training mode, when the model opted in to it.
        self.coupling = coupling_recorder(model)
        self.result: StepResult | None = None
        self._recording: contextlib.ExitStack | None = None

    @property
    def recording(self) -> bool:
        return self._recording is not None

    def __enter__(self) -> TrackingContext:
        stack = contextlib.ExitStack()
        stack.enter_context(installed(self.taps))
        self.forward = stack.enter_context(graph_ops_recorded())
        self.losses = stack.enter_context(recording_losses())
        stack.enter_context(self._recording_penalties())
        stack.enter_context(self._recording_loss_scale())
        if self.coupling is not None:
            stack.enter_context(self.coupling.recording())
        self._recording = stack
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _ACTIVE.reset(self._token)
        if self._recording is not None:
            # The step failed before asking for its gradient (or never asked): the
            # recorders see the error, if any; the taps add a note to it.
            stack, self._recording = self._recording, None
            stack.__exit__(*exc_info)

    def stop_recording(self) -> None:
        """Ends the forward pass' recording (the taps come off the layers)."""
        if self._recording is not None:
            stack, self._recording = self._recording, None
            stack.close()

    def needs_input_gradients(self) -> bool:
        return any(statistic.needs_input_gradients for statistic in self.statistics)

    @contextlib.contextmanager
    def _recording_penalties(self) -> Iterator[None]:
        # Keras computes a penalty by calling `variable.regularizer(variable)` when it
        # collects `model.losses`; whether the step's loss includes it, and with which
        # factor, the backward pass tells.
        regularized = [
            v
            for tracked in self.plan
            for v in tracked.variables
            if getattr(v, "regularizer", None) is not None
        ]

        def recording(variable: Any, regularizer: Any) -> Any:
            def penalty(value: Any) -> Any:
                with graph_ops_recorded() as ops:
                    result = keras.ops.copy(regularizer(value))
                self.penalties.append(Penalty(result, variable, ops.range))
                return result

            return penalty

        changes = [(v, "regularizer", recording(v, v.regularizer)) for v in regularized]
        with patched_each(changes):
            yield

    @contextlib.contextmanager
    def _recording_loss_scale(self) -> Iterator[None]:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            yield
            return
        original = optimizer.scale_loss

        def recording_scale_loss(loss: Any) -> Any:
            one = keras.ops.ones((), "float32")
            self.loss_scale = keras.ops.cast(original(one), "float32")
            return original(loss)

        with patched(optimizer, "scale_loss", recording_scale_loss):
            yield


def active(model: Any) -> TrackingContext | None:
    """The context tracking `model`'s current step, if any."""
    context = _ACTIVE.get()
    return context if context is not None and context.model is model else None


def watch_inputs(model: Any, tape: Any, x: Any) -> None:
    """Watches the batch's float inputs on `tape` when a statistic needs their gradients."""
    context = active(model)
    if context is not None and context.needs_input_gradients():
        context.watched_inputs = float_inputs(x)
        tape.watch(context.watched_inputs)
