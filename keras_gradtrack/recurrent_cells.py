"""The steps of Keras' built-in recurrent cells, split around their input projection.

Each built-in cell computes gate pre-activations `z_t = x_t W + h_{t-1} U (+ b)`
and then its gates. Here the input projection `P = X W` is taken for the whole
sequence before the loop, and the loop adds the recurrent product to `P_t`. The
gradient of the loss at `P` (outside the loop, from the one backward pass) is
then the gradient at the gate pre-activations, `δ_t`, at every step; the loop
emits what the recurrent kernel multiplies (`h_{t-1}`; for a GRU also its reset
gate `r_t`, or `r_t ⊙ h_{t-1}`), so that every weight's per-example gradient is a
sum over time of products of saved sequences (`Term`s):

* SimpleRNN, LSTM: `g^W = Σ_t x_tᵀ δ_t`, `g^U = Σ_t h_{t-1}ᵀ δ_t`, `g^b = Σ_t δ_t`.
* GRU, `reset_after=True`: the candidate's recurrent product is scaled by `r_t`
  after the product, so the gradient at that product is `r_t ⊙ δ^h_t`.
* GRU, `reset_after=False`: the candidate's columns of `U` multiply `r_t ⊙ h_{t-1}`.

Dropout follows the cell: its masks (`get_dropout_mask`, drawn once per call by
the RNN layer and fixed over time; one per gate with `implementation=1`) multiply
what each kernel column sees. Each step does the cell's arithmetic in its order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

# (dropout mask or None, columns of a kernel): gates that share a mask.
Run = tuple[Any, slice]


@dataclasses.dataclass(frozen=True)
class Term:
    """One part of a weight's per-example gradient.

    Attributes:
        variable: The weight.
        inputs: `(B, T, in)`, what the part multiplies; None for a bias, whose
            per-example gradient is `Σ_t grads`.
        grads: `(B, T, out)`, the gradient at the product.
        columns: The columns of the weight's last axis it covers (None: all).
        row: The row of a `(2, out)` GRU bias it covers (None: the whole weight).
    """

    variable: Any
    inputs: Any | None
    grads: Any
    columns: slice | None = None
    row: int | None = None


def runs(masks: Any, units: int, start: int, stop: int) -> list[Run]:
    """The gates `start..stop-1` as runs sharing a dropout mask.

    `masks` is None, one mask for every gate, or a list with one mask per gate.
    """
    if isinstance(masks, (list, tuple)):
        return [(masks[g], slice(g * units, (g + 1) * units)) for g in range(start, stop)]
    return [(masks, slice(start * units, stop * units))]


def masked(sequence: Any, mask: Any) -> Any:
    """`(B, T, d)` times a `(B, d)` mask fixed over time (unchanged without one)."""
    return sequence if mask is None else sequence * mask[:, None, :]


def covers(weight: Any, columns: slice) -> bool:
    return columns.start == 0 and columns.stop == weight.shape[-1]


def columns_of(weight: Any, columns: slice) -> Any:
    """`weight[..., columns]`, the weight itself when they are all of its columns."""
    return weight if covers(weight, columns) else weight[..., columns]


def kernel_term(kernel: Any, inputs: Any, grads: Any, columns: slice) -> Term:
    """The term of `kernel[:, columns]`, for `grads` at the whole product (unsliced, so
    not copied, when the term covers the kernel)."""
    if covers(kernel, columns):
        return Term(kernel, inputs, grads)
    return Term(kernel, inputs, grads[..., columns], columns)


def product(a: Any, kernel: Any, gate_runs: Sequence[Run]) -> Any:
    """`(a ⊙ mask) kernel[:, columns]` per run, side by side (one step, inside the loop)."""
    parts = [
        ops.matmul(a if mask is None else a * mask, columns_of(kernel, columns))
        for mask, columns in gate_runs
    ]
    return ops.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


class CellLoop:
    """The step of one built-in cell, for one call of its RNN layer.

    Args:
        cell: The Keras cell.
        input_masks: The dropout mask of the inputs (None, one `(B, d)` mask, or one
            per gate).
        recurrent_masks: The dropout mask of `h_{t-1}`, alike.

    Example:

    ```python
    loop = loop_of(cell).for_call(cell, training, sequences, initial_state)
    projected = loop.project(sequences)                # (B, T, gates * units)
    output, states, emitted = loop.step(projected[:, 0], initial_state)
    ```
    """

    gates = 1
    # What the step emits besides its output, in order (all `(B, units)`).
    emitted: tuple[str, ...] = ("h_prev",)

    def __init__(self, cell: Any, input_masks: Any = None, recurrent_masks: Any = None):
        self.cell = cell
        self.units = cell.units
        self.input_masks = input_masks
        self.recurrent_masks = recurrent_masks

    @classmethod
    def for_call(
        cls, cell: Any, training: Any, sequences: Any, initial_state: Sequence[Any]
    ) -> CellLoop:
        """The loop of one call, with the masks the cell's own call would take: the RNN
        layer's call draws them before its loop and the cell keeps them until it ends.

        Args:
            training: The call's `training` argument (dropout applies when true).
            sequences: The layer's input `(B, T, d)`.
            initial_state: The loop's initial states (a list).
        """
        input_masks = recurrent_masks = None
        if training and 0.0 < cell.dropout < 1.0:
            input_masks = cell.get_dropout_mask(sequences[:, 0, :])
        if training and 0.0 < cell.recurrent_dropout < 1.0:
            recurrent_masks = cell.get_recurrent_dropout_mask(initial_state[0])
        return cls(cell, input_masks, recurrent_masks)

    def input_runs(self) -> list[Run]:
        return runs(self.input_masks, self.units, 0, self.gates)

    def recurrent_runs(self, start: int = 0, stop: int | None = None) -> list[Run]:
        return runs(self.recurrent_masks, self.units, start, stop or self.gates)

    def input_bias(self) -> Any:
        return self.cell.bias

    def projection(self, sequences: Any, with_bias: bool) -> Any:
        """`X W` for the whole sequence `(B, T, d)`, plus the input bias if asked."""
        parts = []
        for mask, columns in self.input_runs():
            kernel = columns_of(self.cell.kernel, columns)
            part = ops.einsum("btd,dg->btg", masked(sequences, mask), kernel)
            if with_bias:
                part = part + columns_of(self.input_bias(), columns)
            parts.append(part)
        return ops.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def kernel_terms(self, inputs: Any, grads: Any) -> list[Term]:
        return [
            kernel_term(self.cell.kernel, masked(inputs, mask), grads, columns)
            for mask, columns in self.input_runs()
        ]

    def recurrent_terms(self, sequence: Any, grads: Any, gate_runs: Sequence[Run]) -> list[Term]:
        return [
            kernel_term(self.cell.recurrent_kernel, masked(sequence, mask), grads, columns)
            for mask, columns in gate_runs
        ]

    # Each cell: the projection taken before the loop, the step, and the terms.
    def project(self, sequences: Any) -> Any:
        raise NotImplementedError

    def step(self, projected: Any, states: Sequence[Any]) -> tuple[Any, list, list]:
        """`(output, new states, emitted)` of one step from `P_t` and the states."""
        raise NotImplementedError

    def terms(self, inputs: Any, saved: dict[str, Any], grads: Any) -> list[Term]:
        """The terms from the layer's input, the emitted sequences and `δ = dL/dP`."""
        raise NotImplementedError


class SimpleRNNLoop(CellLoop):
    """`h_t = act(x_t W + b + h_{t-1} U)`."""

    def project(self, sequences: Any) -> Any:
        return self.projection(sequences, with_bias=self.cell.bias is not None)

    def step(self, projected: Any, states: Sequence[Any]) -> tuple[Any, list, list]:
        h_prev = states[0]
        output = projected + product(h_prev, self.cell.recurrent_kernel, self.recurrent_runs())
        if self.cell.activation is not None:
            output = self.cell.activation(output)
        return output, [output], [h_prev]

    def terms(self, inputs: Any, saved: dict[str, Any], grads: Any) -> list[Term]:
        terms = self.kernel_terms(inputs, grads)
        terms += self.recurrent_terms(saved["h_prev"], grads, self.recurrent_runs())
        if self.cell.bias is not None:
            terms.append(Term(self.cell.bias, None, grads))
        return terms


class LSTMLoop(CellLoop):
    """`z_t = x_t W + h_{t-1} U + b`; gates i, f, o and `c_t = f c_{t-1} + i act(z^c_t)`."""

    gates = 4

    def bias_in_projection(self) -> bool:
        # implementation=1 adds each gate's bias to its input product (Keras' order).
        return bool(self.cell.use_bias) and self.cell.implementation == 1

    def project(self, sequences: Any) -> Any:
        return self.projection(sequences, with_bias=self.bias_in_projection())

    def step(self, projected: Any, states: Sequence[Any]) -> tuple[Any, list, list]:
        cell = self.cell
        h_prev, c_prev = states[0], states[1]
        z = projected + product(h_prev, cell.recurrent_kernel, self.recurrent_runs())
        if cell.use_bias and not self.bias_in_projection():
            z = z + cell.bias
        z_i, z_f, z_c, z_o = ops.split(z, 4, axis=-1)
        i = cell.recurrent_activation(z_i)
        f = cell.recurrent_activation(z_f)
        c = f * c_prev + i * cell.activation(z_c)
        o = cell.recurrent_activation(z_o)
        h = o * cell.activation(c)
        return h, [h, c], [h_prev]

    def terms(self, inputs: Any, saved: dict[str, Any], grads: Any) -> list[Term]:
        terms = self.kernel_terms(inputs, grads)
        terms += self.recurrent_terms(saved["h_prev"], grads, self.recurrent_runs())
        if self.cell.use_bias:
            terms.append(Term(self.cell.bias, None, grads))
        return terms


class GRULoop(CellLoop):
    """Gates z, r; candidate `act(x_t W^h + r_t ⊙ (h_{t-1} U^h))` with `reset_after`,
    else `act(x_t W^h + (r_t ⊙ h_{t-1}) U^h)`; `h_t = z h_{t-1} + (1 - z) candidate`."""

    gates = 3

    def __init__(self, cell: Any, *masks: Any):
        super().__init__(cell, *masks)
        self.emitted = ("h_prev", "reset") if cell.reset_after else ("h_prev", "reset_h_prev")

    def input_bias(self) -> Any:
        return self.cell.bias[0] if self.cell.reset_after else self.cell.bias

    def project(self, sequences: Any) -> Any:
        return self.projection(sequences, with_bias=bool(self.cell.use_bias))

    def step(self, projected: Any, states: Sequence[Any]) -> tuple[Any, list, list]:
        cell, units = self.cell, self.units
        h_prev = states[0]
        x_z, x_r, x_h = ops.split(projected, 3, axis=-1)
        if cell.reset_after:
            inner = product(h_prev, cell.recurrent_kernel, self.recurrent_runs())
            if cell.use_bias:
                inner = inner + cell.bias[1]
            z = cell.recurrent_activation(x_z + inner[:, :units])
            r = cell.recurrent_activation(x_r + inner[:, units : 2 * units])
            candidate = cell.activation(x_h + r * inner[:, 2 * units :])
            emitted = [h_prev, r]
        else:
            inner = product(h_prev, cell.recurrent_kernel, self.recurrent_runs(0, 2))
            z = cell.recurrent_activation(x_z + inner[:, :units])
            r = cell.recurrent_activation(x_r + inner[:, units:])
            reset_h_prev = r * h_prev
            recurrent_h = product(reset_h_prev, cell.recurrent_kernel, self.recurrent_runs(2, 3))
            candidate = cell.activation(x_h + recurrent_h)
            emitted = [h_prev, reset_h_prev]
        h = z * h_prev + (1 - z) * candidate
        return h, [h], emitted

    def terms(self, inputs: Any, saved: dict[str, Any], grads: Any) -> list[Term]:
        cell, units = self.cell, self.units
        terms = self.kernel_terms(inputs, grads)
        if not cell.reset_after:
            terms += self.recurrent_terms(saved["h_prev"], grads, self.recurrent_runs(0, 2))
            terms += self.recurrent_terms(saved["reset_h_prev"], grads, self.recurrent_runs(2, 3))
            if cell.use_bias:
                terms.append(Term(cell.bias, None, grads))
            return terms
        # The candidate's recurrent product is scaled by r_t after the product. Its
        # terms are apart from the gates' (not one `(B, T, 3 units)` gradient put
        # together): a sequence-sized concatenation would be the step's largest copy.
        gates = slice(0, 2 * units)
        candidate = slice(2 * units, 3 * units)
        candidate_grads = grads[..., candidate] * saved["reset"]
        terms += self.recurrent_terms(saved["h_prev"], grads, self.recurrent_runs(0, 2))
        terms += [
            Term(cell.recurrent_kernel, masked(saved["h_prev"], mask), candidate_grads, columns)
            for mask, columns in self.recurrent_runs(2, 3)
        ]
        if cell.use_bias:
            terms.append(Term(cell.bias, None, grads, row=0))
            terms.append(Term(cell.bias, None, grads[..., gates], gates, row=1))
            terms.append(Term(cell.bias, None, candidate_grads, candidate, row=1))
        return terms


# The cells whose step is written here; a subclass keeping the cell's `call` too.
CELL_LOOPS: tuple[tuple[type, type[CellLoop]], ...] = (
    (keras.layers.SimpleRNNCell, SimpleRNNLoop),
    (keras.layers.LSTMCell, LSTMLoop),
    (keras.layers.GRUCell, GRULoop),
)


def loop_of(cell: Any) -> type[CellLoop] | None:
    """The `CellLoop` class of a built-in cell, or None for any other cell."""
    for cell_class, loop in CELL_LOOPS:
        if isinstance(cell, cell_class) and type(cell).call is cell_class.call:
            return loop
    return None


def on_a_loop(cell: Any) -> bool:
    """Whether both engines' recurrent rule covers the cell: a built-in SimpleRNN, LSTM or
    GRU cell (or a subclass keeping its `call`) with every weight trained."""
    if loop_of(cell) is None:
        return False
    weights = [cell.kernel, cell.recurrent_kernel, cell.bias]
    return all(w.trainable for w in weights if w is not None)


def term_gradient(term: Term) -> Any:
    """`(B, in, out)` `Σ_t a_tᵀ δ_t`, or `(B, out)` `Σ_t δ_t` for a bias."""
    if term.inputs is None:
        return ops.sum(term.grads, axis=1)
    return ops.einsum("bti,bto->bio", term.inputs, term.grads)


def per_example_gradients(
    terms: Sequence[Term], gradient: Callable[[Term], Any] = term_gradient
) -> list[tuple[Any, Any]]:
    """`[(weight, (B, *weight.shape) gradient)]` from the terms: each weight's terms
    side by side along its columns (and its rows, for a GRU's `(2, 3 units)` bias).

    Example:

    ```python
    pairs = per_example_gradients(loop.terms(inputs, emitted, grads))
    ```
    """
    parts: dict[int, list[Term]] = {}
    variables = {}
    for term in terms:
        parts.setdefault(id(term.variable), []).append(term)
        variables[id(term.variable)] = term.variable
    pairs = []
    for key, weight_terms in parts.items():
        if weight_terms[0].row is not None:
            rows = sorted({term.row for term in weight_terms if term.row is not None})
            grad = ops.stack(
                [side_by_side([t for t in weight_terms if t.row == row], gradient) for row in rows],
                axis=1,
            )
        else:
            grad = side_by_side(weight_terms, gradient)
        pairs.append((variables[key], grad))
    return pairs


def side_by_side(terms: Sequence[Term], gradient: Callable[[Term], Any] = term_gradient) -> Any:
    """The per-example gradient of the columns that `terms` cover together, in order."""
    ordered = sorted(terms, key=lambda t: 0 if t.columns is None else t.columns.start)
    grads = [gradient(term) for term in ordered]
    return ops.concatenate(grads, axis=-1) if len(grads) > 1 else grads[0]
