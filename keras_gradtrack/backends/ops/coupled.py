"""What the probed engines (JAX, PyTorch) share about BatchNormalization in training.

In training mode BatchNormalization normalizes with the batch's mean and variance, so
example i's loss depends on the outputs of every example at the layers before it.
With the model's opt-in (`model.track_batch_normalization = True`), `g_i = d l_i / d
theta` holds the other examples fixed and includes the terms through the batch
statistics (`sum_i g_i = G` without penalties), as on TensorFlow (`engine/coupled.py`,
the definition every engine shares). A layer whose variables reach the input of a
BatchNormalization call in training mode is *coupled* (and so is a BatchNormalization
in training without a rule, batch renormalization, or one called with a mask): its
per-example gradients are the rows of the Jacobian of the per-example losses (each
backend's `coupled.py`: `jax.vjp`, `torch.autograd.grad`). Every other layer keeps its
rule, a BatchNormalization's own gamma and beta included where no other one follows. Shared here: which
layers mix (`mixing_layers`), the record of their calls with the batch's moments
(`recording_mixing_calls`), what a step's coupling holds (`Coupling`) and the
summary's path (`coupled_path`).

Example:

```python
with recording_mixing_calls(mixing_layers(model)) as calls:
    model(x, training=True)
[layer.name for layer, _, _ in calls]     # the BatchNormalization calls in training
```
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from keras_gradtrack._keras_seam import flatten_layers
from keras_gradtrack._patching import patched_each
from keras_gradtrack.backends.ops.plan import TrackedLayer
from keras_gradtrack.backends.ops.rules import LayerPrimitives
from keras_gradtrack.rule_math import uses_batch_statistics

COUPLED_PATH = "coupled (per-example vjp through BatchNormalization's batch statistics)"
# Where the model keeps the names of the layers its last tracked step coupled.
COUPLED_NAMES_KEY = "_coupled_layer_names"


def mixing_layers(model: Any) -> list[Any]:
    """The model's trainable BatchNormalization layers (they mix examples in training)."""
    return [
        layer
        for layer in flatten_layers(model, include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]


@contextlib.contextmanager
def recording_mixing_calls(layers: Sequence[Any]) -> Iterator[list[tuple[Any, Any, bool]]]:
    """Records `(layer, input, masked)` of each call of `layers` that uses the batch's
    moments."""
    calls: list[tuple[Any, Any, bool]] = []

    def recording(layer: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        def recording_call(*args: Any, **kwargs: Any) -> Any:
            if uses_batch_statistics(layer, args, kwargs):
                masked = (args[2] if len(args) > 2 else kwargs.get("mask")) is not None
                calls.append((layer, args[0] if args else kwargs["inputs"], masked))
            return call(*args, **kwargs)

        return recording_call

    # An instance attribute shadows the class's `call` (as the probes do).
    with patched_each([(layer, "call", recording(layer, layer.call)) for layer in layers]):
        yield calls


def coupled_path(
    model: Any, tracked: TrackedLayer, functional_coupling: Callable[[Any], frozenset[str]]
) -> str:
    """The summary's path of a layer: `COUPLED_PATH` where the model's last traced step
    coupled it (before any, where `functional_coupling(model)`, a forward pass on its
    functional inputs, does), else its own."""
    names = model.__dict__.get(COUPLED_NAMES_KEY)
    if names is None:
        names = functional_coupling(model)
    return COUPLED_PATH if tracked.name in names else tracked.path


@dataclasses.dataclass(frozen=True)
class Coupling:
    """What BatchNormalization in training couples in one tracked step.

    Attributes:
        columns: `{position in plan: (primitives, ||G^(k)||^2)}` of the coupled layers.
        mixing: The names of the layers called with the batch's moments (then no
            example's input gradient is its own: `d l_j / d x_i` is not zero).
        grams: `() -> {position in plan: (B, B) Gram matrix}` of the coupled layers,
            from their rows (`chunk x` their parameters at a time; all rows once).
    """

    columns: dict[int, tuple[LayerPrimitives, Any]] = dataclasses.field(default_factory=dict)
    mixing: Sequence[str] = ()
    grams: Callable[[], dict[int, Any]] = dict
