"""Recurrent layers on the probed engines: SimpleRNN, LSTM and GRU on one rule, inside
Keras' own loop (`lax.scan` on JAX, a Python loop over the steps on PyTorch).

The layer's own `call` runs (initial and stateful states, masks, `go_backwards`,
`return_sequences`, `return_state`, `unroll`: all Keras'), with its `inner_loop`
replaced by Keras' own `backend.rnn` (`lax.scan`) over the cell's step split around
its input projection (`keras_gradtrack/recurrent_cells.py`, the TensorFlow engine's
steps too): `P = X W` is taken for the whole sequence before the scan, and the
probe is added to `P`. Its gradient is then `δ_t`, example i's gradient at the gate
pre-activations at every step, and the scan emits, beside each step's output, what
the recurrent kernel multiplies (`h_{t-1}`; for a GRU its reset gate too). Each
weight's per-example gradient is a sum over time, `Σ_t a_tᵀ δ_t`
(`recurrent_cells.per_example_gradients`); a masked step's `δ_t` is zero (the scan
keeps the previous states there).

Keras' loop stacks one tensor per step (its masking compares it with the
first state), so the step's output and what it emits travel as one concatenation,
`[h_t, emitted...]`, and the loop carries the previous concatenation as an extra
first state: a masked step repeats it whole, as Keras repeats `h_{t-1}`.

Example:

```python
probed = recurrent_call(layer, layer.call, (x,), {}, add_probe)   # inside the step
outputs, saved = probed                     # saved: the sequences the rule reads
```
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops, tree

from keras_gradtrack._keras_seam import flatten_layers, keras_backend
from keras_gradtrack._patching import patched
from keras_gradtrack.backends.ops.rules import ProbedCall, ProbedRule, backend_name
from keras_gradtrack.engine.repeatable_calls import unrepeatable_call
from keras_gradtrack.recurrent_cells import loop_of, on_a_loop, per_example_gradients


def f32(value: Any) -> Any:
    return ops.cast(value, "float32")


def off_the_rule() -> str:
    """Why a recurrent layer is off the rule, as the refusals say it."""
    return (
        f"on {backend_name()} the recurrent rule covers Keras' SimpleRNN, LSTM and GRU "
        "cells with every cell weight trained"
    )


BUILT_IN = (keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU, keras.layers.RNN)


def cell_of(layer: Any) -> Any:
    """The cell whose variables a recurrent layer's column holds (None: not recurrent)."""
    return layer.cell if isinstance(layer, keras.layers.RNN) else None


def keeps_keras_call(layer: Any) -> bool:
    """The layer's class is a built-in recurrent layer, or a subclass keeping its `call`
    and `inner_loop`."""
    for cls in type(layer).__mro__:
        if cls in BUILT_IN:
            return all(getattr(type(layer), n) is getattr(cls, n) for n in ("call", "inner_loop"))
    return False


def on_the_rule(layer: Any) -> bool:
    """Whether the recurrent rule covers the layer: Keras' SimpleRNN, LSTM or GRU (or
    `keras.layers.RNN` over their cells) keeping Keras' `call` and `inner_loop`, every
    cell weight trained. Another recurrent layer runs on the per-layer fallback."""
    return cell_of(layer) is not None and keeps_keras_call(layer) and on_a_loop(layer.cell)


def cell_layers(layer: Any) -> list[Any]:
    """The cell of a recurrent layer and every layer inside it (a `StackedRNNCells`'
    cells): the recurrent layer's column holds their variables."""
    cell = cell_of(layer)
    return [] if cell is None else flatten_layers(cell)


def recurrent_refusal(layer: Any) -> str:
    """Why the engine cannot track a recurrent layer off the recurrent rule (empty
    when it can, or when the layer is not recurrent or trains nothing).

    Off the rule, a recurrent layer runs on the per-layer fallback, `vmap(grad)` of the
    layer's own call on each example: exact for any cell, provided the call on one
    example computes what the step computed for it. A `stateful` layer and a cell with
    dropout break that, and are refused as on TensorFlow (`engine/repeatable_calls.py`).
    Returned states are probed beside the output (`rules.output_rows`)."""
    cell = cell_of(layer)
    if cell is None or not layer.trainable_variables or on_the_rule(layer):
        return ""
    return unrepeatable_call(layer, off_the_rule())


def recurrent_call(
    layer: Any,
    call: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    add_probe: Callable[[Any], Any],
) -> tuple[Any, dict[str, Any]]:
    """`(outputs, saved)`: the layer's own call with its loop split, `add_probe` applied
    to `P`; `saved` holds the layer's input sequences, the emitted ones (in the
    input's order) and the dropout masks, for the rule."""
    saved: dict[str, Any] = {}

    def inner_loop(sequences: Any, initial_state: Any, mask: Any, training: Any = False) -> Any:
        if tree.is_nested(mask):
            mask = mask[0]
        if not tree.is_nested(initial_state):
            initial_state = [initial_state]
        cell = layer.cell
        loop = loop_of(cell).for_call(cell, training, sequences, initial_state)  # type: ignore[union-attr]
        projected = add_probe(loop.project(sequences))
        sizes = [cell.units] * (1 + len(loop.emitted))

        def step(projected_t: Any, states: Any) -> tuple[Any, list[Any]]:
            output, new_states, emitted = loop.step(projected_t, list(states[1:]))
            packed = ops.concatenate([output, *emitted], axis=-1)
            return packed, [packed, *new_states]

        first = initial_state[0]
        packed_state = ops.concatenate([first] + [ops.zeros_like(first)] * (len(sizes) - 1), -1)
        last, outputs, states = keras_backend.rnn(
            step,
            projected,
            [packed_state, *initial_state],
            go_backwards=layer.go_backwards,
            mask=mask,
            unroll=layer.unroll,
            input_length=sequences.shape[1],
            zero_output_for_mask=layer.zero_output_for_mask,
            return_all_outputs=True,
        )
        outputs, *emitted = ops.split(outputs, len(sizes), axis=-1)
        if layer.go_backwards:  # the scan's order; pair each step with its input
            emitted = [ops.flip(sequence, axis=1) for sequence in emitted]
        saved.update(
            inputs=sequences,
            input_masks=as_pytree(loop.input_masks),
            recurrent_masks=as_pytree(loop.recurrent_masks),
            **dict(zip(loop.emitted, emitted)),
        )
        return last[:, : cell.units], outputs, list(states[1:])

    # Off Keras' fused paths (cuDNN, and Bidirectional's two directions at once), which
    # would not run the layer's `inner_loop`.
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(layer, "inner_loop", inner_loop))
        if hasattr(layer, "use_cudnn"):  # LSTM and GRU
            stack.enter_context(patched(layer, "use_cudnn", False))
        outputs = call(*args, **kwargs)
    if "inputs" not in saved:
        raise RuntimeError(
            f"Layer {layer.name!r} ({type(layer).__name__}) did not run its inner_loop in "
            "call(), so the recurrent rule cannot see its steps."
        )
    return outputs, saved


def as_pytree(masks: Any) -> Any:
    """A cell's dropout masks as a list (the cell keeps one per gate in a Keras
    `TrackedList`, which JAX's trace does not know)."""
    return list(masks) if isinstance(masks, (list, tuple)) else masks


def recurrent_per_example(
    layer: Any, values: Sequence[Any], call: ProbedCall, others: Sequence[Any] = ()
) -> list[Any]:
    """The cell's weights' per-example gradients, `(B, *weight.shape)` each, from the
    saved sequences and `δ = dL/dP` (`call.inputs` is the recorded `saved`)."""
    saved, cell = call.inputs, layer.cell
    loop_class = loop_of(cell)
    assert loop_class is not None  # the plan refused other cells
    loop = loop_class(cell, saved["input_masks"], saved["recurrent_masks"])
    emitted = {name: f32(saved[name]) for name in loop.emitted}
    terms = loop.terms(f32(saved["inputs"]), emitted, f32(call.output_grad))
    grads = {id(variable): grad for variable, grad in per_example_gradients(terms)}
    return [f32(grads[id(v)]) for v in layer.trainable_variables]


RECURRENT = ProbedRule("recurrent", recurrent_per_example, applies=on_the_rule)


def output_rows(outputs: Any) -> Any:
    """A layer's output as its probe sees it: one tensor as it is; several (a recurrent
    layer's sequence and states) as one `(B, n)`, each output's rows flattened and
    concatenated in `keras.tree` order."""
    leaves = tree.flatten(outputs)
    if len(leaves) == 1 and not isinstance(outputs, (list, tuple, dict)):
        return outputs
    return ops.concatenate([ops.reshape(leaf, (leaf.shape[0], -1)) for leaf in leaves], axis=1)


def from_output_rows(rows: Any, outputs: Any) -> Any:
    """`outputs` (several tensors) with the values of `rows` (`output_rows(outputs)`
    plus a probe)."""
    leaves = tree.flatten(outputs)
    sizes = [math.prod(leaf.shape[1:]) for leaf in leaves]
    offsets = [sum(sizes[:n]) for n in range(1, len(sizes))]
    parts = ops.split(rows, offsets, axis=1)
    return tree.pack_sequence_as(
        outputs, [ops.reshape(part, leaf.shape) for part, leaf in zip(parts, leaves)]
    )
