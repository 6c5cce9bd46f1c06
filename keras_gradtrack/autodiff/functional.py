"""`grad`, `vjp`, `jvp`, `jacobian`, `batch_jacobian` and output gradients on JAX and
PyTorch, written once over a backend's two primitives.

`fn` is run as a function of the values differentiated: a tensor or numpy array is
one of them, and a Keras variable is replaced by one for the call
(`keras.StatelessScope`), so that its gradient is found however `fn` reads it, as
on TensorFlow. A backend (`autodiff/jax_primitives.py`, `autodiff/torch_primitives.py`)
gives the reverse-mode linearization of such a function (its outputs and a pull-back,
one cotangent or a stack of them) and its forward-mode product. Everything else, the
arguments, the one-hot cotangents of Jacobian rows and output features, the chunks
and the reshapes, is here, in `keras.ops`.

On JAX a Keras layer or model given as `fn` runs in one `jax.jit` of the values and
of the model's variables, read at each call (`_compiled_call`); anything else runs
eagerly, and `jit_compile=True` is refused for it, since a compiled trace would hold
the values of the variables `fn` reads without being given them. PyTorch runs
eagerly. Unlike TensorFlow, JAX cannot tell an
input the output does not depend on from one whose gradient is zero, so there it gets
zeros; PyTorch raises as TensorFlow does.

Example:

```python
# KERAS_BACKEND=jax or torch
dx = keras_gradtrack.autodiff.grad(model, x)  # d sum(model(x)) / dx
```
"""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gradtrack.autodiff.arguments import (
    FeatureGradientSettings,
    check_chunk_size,
    check_feature_axis,
    mismatched_shape,
    mismatched_structure,
    named_leaves,
    shapes_of,
)

CUT_GRADIENT_HINT = (
    "Make sure fn computes its output from it with differentiable operations: integer "
    "casts, argmax, `keras.ops.stop_gradient` and numpy round trips (`np.asarray`, "
    "`model.predict`) cut the gradient."
)


def _primitives() -> Any:
    if keras.backend.backend() == "jax":
        from keras_gradtrack.autodiff import jax_primitives

        return jax_primitives
    from keras_gradtrack.autodiff import torch_primitives

    return torch_primitives


class _Linearized:
    """`fn` at the sources' values, reverse mode: its outputs and the pull-back."""

    def __init__(
        self, fn: Callable, sources: _Sources, compiled: bool = False, argument: Any = None
    ) -> None:
        self.sources = sources
        self.structure: Any = None
        self.outputs, self._pull_back = _primitives().linearize(
            sources.function_of_values(fn, self, compiled, argument), sources.values
        )

    def pull_back(self, cotangents: list[Any], batched: bool = False) -> list[Any]:
        """The sources' gradients (each stacked along a first axis when `batched`)."""
        gradients = self._pull_back(cotangents, batched)
        for (name, leaf), gradient in zip(self.sources.named, gradients):
            if gradient is None:
                _raise_not_connected(name, leaf)
        return gradients


class _Sources:
    """What to differentiate with respect to: floating-point values, or Keras variables
    (replaced for the call by values of their own)."""

    def __init__(self, structure: Any, name: str) -> None:
        self.structure = structure
        self.named = named_leaves(structure, name)
        self.values = []
        for leaf_name, leaf in self.named:
            value = leaf.value if isinstance(leaf, keras.Variable) else ops.convert_to_tensor(leaf)
            dtype = keras.backend.standardize_dtype(value.dtype)
            if not (
                dtype.startswith("float") or dtype.startswith("complex") or dtype == "bfloat16"
            ):
                raise TypeError(
                    f"Gradients are defined for floating-point inputs only, but {leaf_name} "
                    f"has dtype {dtype}. Cast it first, e.g. `keras.ops.cast(x, 'float32')`."
                )
            self.values.append(value)

    def function_of_values(
        self, fn: Callable, record: Any, compiled: bool = False, argument: Any = None
    ) -> Callable[[list[Any]], list[Any]]:
        """`fn` as a function of the flat values; the outputs' structure kept on `record`.
        `compiled`: `fn` is a Keras layer, called in one compiled function of the values
        and of its variables' current values (`_compiled_call`). `argument`: what `fn`
        is called with, when not the values (the sources are variables it reads)."""
        if compiled:
            call = _compiled_call(fn, self, argument is not None)
        else:
            call = self.call_of(fn, applied=argument is not None)

        def function(values: list[Any]) -> list[Any]:
            outputs = call(values, argument)
            record.structure = outputs
            return keras.tree.flatten(outputs)

        return function

    def call_of(
        self, fn: Callable, state: list[Any] | None = None, applied: bool = False
    ) -> Callable[..., Any]:
        """`fn` at the values (and, given `state`, its layer's variables at `state`),
        called with the values, or with `argument` when `applied`."""
        leaves = [leaf for _, leaf in self.named]

        def call(values: list[Any], argument: Any, state_values: Sequence[Any] = ()) -> Any:
            mapping = list(zip(state or [], state_values))
            mapping += [
                (leaf, value)
                for leaf, value in zip(leaves, values)
                if isinstance(leaf, keras.Variable)
            ]
            arguments = [
                leaf if isinstance(leaf, keras.Variable) else value
                for leaf, value in zip(leaves, values)
            ]
            inputs = argument if applied else keras.tree.pack_sequence_as(self.structure, arguments)
            with keras.StatelessScope(state_mapping=mapping):
                outputs = fn(inputs)
            _check_tensor_outputs(outputs)
            return outputs

        return call

    def packed(self, flat: list[Any]) -> Any:
        return keras.tree.pack_sequence_as(self.structure, flat)


# Per Keras layer given as `fn`: its compiled calls, one per set of sources (which
# leaves are which variables, and the structure they come in).
_COMPILED: weakref.WeakKeyDictionary[Any, dict[Any, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _compiled_call(layer: Any, sources: _Sources, applied: bool) -> Callable[..., Any]:
    """`layer` at the values in one `jax.jit` of the values and of every variable of the
    layer (read at each call, so a compiled call never holds stale weights), kept across
    calls with the same sources."""
    key = (
        tuple(id(leaf) if isinstance(leaf, keras.Variable) else None for _, leaf in sources.named),
        repr(keras.tree.map_structure(lambda _: None, sources.structure)),
        applied,
    )
    calls = _COMPILED.setdefault(layer, {})
    state = list(layer.variables)
    if key not in calls:
        # The compiled call holds the layer weakly: a strong reference from the value
        # of a WeakKeyDictionary to its key would keep every model ever given alive.
        layer_ref = weakref.ref(layer)

        def layer_call(inputs: Any) -> Any:
            alive = layer_ref()
            assert alive is not None  # the entry goes with its layer
            return alive(inputs)

        calls[key] = _primitives().jit(sources.call_of(layer_call, state, applied))
    compiled = calls[key]
    return lambda values, argument: compiled(values, argument, [v.value for v in state])


def _compiles(jit_compile: Any, fn: Callable) -> bool:
    """Whether `fn` runs compiled: on JAX, a Keras layer or model unless
    `jit_compile=False`; never on PyTorch (`jit_compile=True` refused there, and on JAX
    for a `fn` that is not a Keras layer)."""
    backend = keras.backend.backend()
    layer = isinstance(fn, keras.Layer)
    if jit_compile and not (backend == "jax" and layer):
        where = "a function that is not a Keras layer or model" if backend == "jax" else backend
        raise ValueError(
            f"keras_gradtrack.autodiff runs {where} eagerly: a compiled trace would keep "
            "the values of the variables fn reads without being given them. Use "
            "`jit_compile=None`, or compile fn itself (`jax.jit` over `stateless_call`, "
            f"`torch.compile`). Received: jit_compile={jit_compile!r}"
        )
    return backend == "jax" and layer and jit_compile is not False


def _check_tensor_outputs(outputs: Any) -> None:
    for name, leaf in named_leaves(outputs, "fn's output"):
        if not ops.is_tensor(leaf):
            received = (
                f"a numpy array of shape {np.shape(leaf)}"
                if isinstance(leaf, np.ndarray | np.generic)
                else f"a {type(leaf).__name__}"
            )
            raise TypeError(
                f"fn must return tensors, but {name} is {received}. Gradients flow only "
                "through the backend's operations on the values fn receives, and "
                "`model.predict(x)` returns numpy. Call the model instead: "
                "`fn = lambda x: model(x)`."
            )


def _raise_not_connected(name: str, leaf: Any) -> None:
    path = f"'{leaf.path}', " if isinstance(leaf, keras.Variable) else ""
    message = (
        f"fn's output does not depend on {name} ({path}shape {tuple(leaf.shape)}), so its "
        f"gradient is undefined. {CUT_GRADIENT_HINT}"
    )
    if not path:
        message += (
            " To differentiate with respect to a model's weights, pass the variables "
            "themselves (e.g. `model.trainable_variables`), not their values."
        )
    raise ValueError(message)


def _matched_to(values: Any, reference: Any, name: str, reference_name: str) -> list[Any]:
    """Flattens `values`, checked against `reference`'s structure and shapes, in its dtypes."""
    try:
        keras.tree.assert_same_structure(values, reference)
    except (ValueError, TypeError):
        raise mismatched_structure(name, values, reference, reference_name) from None
    matched = []
    for (value_name, value), ref in zip(named_leaves(values, name), keras.tree.flatten(reference)):
        value = ops.convert_to_tensor(value)
        if tuple(value.shape) != tuple(ref.shape):
            raise mismatched_shape(value_name, value.shape, ref.shape, reference_name)
        matched.append(ops.cast(value, ref.dtype))
    return matched


def grad(fn: Callable, inputs: Any, grad_outputs: Any = None, *, jit_compile=None) -> Any:
    """`keras_gradtrack.autodiff.grad` on JAX and PyTorch (see its TensorFlow docstring)."""
    compiled = _compiles(jit_compile, fn)
    sources = _Sources(inputs, "inputs")
    linearized = _Linearized(fn, sources, compiled)
    if grad_outputs is None:
        cotangents = [ops.ones_like(y) for y in linearized.outputs]
    else:
        cotangents = _matched_to(grad_outputs, linearized.structure, "grad_outputs", "fn's output")
    return sources.packed(linearized.pull_back(cotangents))


def vjp(fn: Callable, primals: Any, cotangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """`keras_gradtrack.autodiff.vjp` on JAX and PyTorch: `(fn(primals), cotangents^T J)`."""
    compiled = _compiles(jit_compile, fn)
    sources = _Sources(primals, "primals")
    linearized = _Linearized(fn, sources, compiled)
    matched = _matched_to(cotangents, linearized.structure, "cotangents", "fn's output")
    outputs = keras.tree.pack_sequence_as(linearized.structure, linearized.outputs)
    return outputs, sources.packed(linearized.pull_back(matched))


def jvp(fn: Callable, primals: Any, tangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """`keras_gradtrack.autodiff.jvp` on JAX and PyTorch: `(fn(primals), J tangents)` in
    forward mode."""
    compiled = _compiles(jit_compile, fn)
    sources = _Sources(primals, "primals")
    matched = _matched_to(tangents, sources.structure, "tangents", "primals")
    record = types.SimpleNamespace(structure=None)
    outputs, jvps = _primitives().forward_product(
        sources.function_of_values(fn, record, compiled), sources.values, matched
    )
    structure = record.structure
    return (
        keras.tree.pack_sequence_as(structure, outputs),
        keras.tree.pack_sequence_as(structure, jvps),
    )


def jacobian(fn: Callable, x: Any, chunk_size: int | None = None, *, jit_compile=None) -> Any:
    """`keras_gradtrack.autodiff.jacobian` on JAX and PyTorch: shape `y.shape + x.shape`,
    `chunk_size` rows per batched pull-back."""
    compiled = _compiles(jit_compile, fn)
    check_chunk_size(chunk_size, allow_none=True)
    sources = _Sources(x, "x")
    linearized = _Linearized(fn, sources, compiled)
    y = _single_output(linearized)
    rows = _basis_pull_backs(linearized, y, tuple(range(len(y.shape))), chunk_size)
    return sources.packed(
        [
            ops.reshape(row, tuple(y.shape) + tuple(value.shape))
            for row, value in zip(rows, sources.values)
        ]
    )


def batch_jacobian(fn: Callable, x: Any, chunk_size: int | None = None, *, jit_compile=None):
    """`keras_gradtrack.autodiff.batch_jacobian` on JAX and PyTorch: `d y[i] / d x[i]`,
    shape `(B,) + y.shape[1:] + x.shape[1:]`."""
    compiled = _compiles(jit_compile, fn)
    check_chunk_size(chunk_size, allow_none=True)
    if isinstance(x, list | tuple | dict):
        raise TypeError(f"`x` must be one tensor. Received: x={shapes_of(x)}")
    sources = _Sources(x, "x")
    linearized = _Linearized(fn, sources, compiled)
    y = _single_output(linearized)
    value = sources.values[0]
    if len(y.shape) == 0 or y.shape[0] != value.shape[0]:
        raise ValueError(
            "batch_jacobian needs fn(x) to keep the batch axis of x. "
            f"Received: x.shape={tuple(value.shape)}, fn(x).shape={tuple(y.shape)}"
        )
    # rows[k, i] = d y[i, k] / d x[i], with k running over y[i] flattened.
    (rows,) = _basis_pull_backs(linearized, y, tuple(range(1, len(y.shape))), chunk_size)
    rows = ops.moveaxis(rows, 0, 1)
    return ops.reshape(rows, tuple(y.shape) + tuple(value.shape[1:]))


def _single_output(linearized: _Linearized) -> Any:
    if len(linearized.outputs) != 1 or isinstance(linearized.structure, list | tuple | dict):
        raise TypeError(
            "fn must return one tensor (e.g. `lambda x: model(x)[0]` for a model with "
            f"several outputs). Received outputs with shapes {shapes_of(linearized.structure)}"
        )
    return linearized.outputs[0]


def _basis_pull_backs(
    linearized: _Linearized, y: Any, axes: tuple[int, ...], chunk_size: int | None
) -> list[Any]:
    """`d sum(y[..., i, ...]) / d sources` for every index `i` of `axes` (row-major),
    stacked, `chunk_size` batched pull-backs at a time."""
    sizes = [y.shape[axis] if axis in axes else 1 for axis in range(len(y.shape))]
    num_rows = math.prod(sizes)
    chunk_size = num_rows if chunk_size is None else min(chunk_size, num_rows)
    chunks: list[list[Any]] = []
    for start in range(0, num_rows, chunk_size):
        indices = ops.arange(start, min(start + chunk_size, num_rows))
        one_hot = ops.cast(ops.one_hot(indices, num_rows), y.dtype)
        cotangents = ops.broadcast_to(
            ops.reshape(one_hot, (-1, *sizes)), (int(indices.shape[0]), *y.shape)
        )
        chunks.append(linearized.pull_back([cotangents], batched=True))
    return [ops.concatenate(parts, axis=0) for parts in zip(*chunks)]


class OutputGradients(FeatureGradientSettings):
    """`keras_gradtrack.autodiff.OutputGradients` on JAX and PyTorch: one forward pass
    per call, then one pull-back per feature, one after another."""

    def _compile(self, jit_compile: bool | None) -> None:
        self._compiled = _compiles(jit_compile, self._model)

    def __call__(self, x: Any) -> Iterator[tuple[np.ndarray, list[Any]]]:
        """Streams `(feature_indices, grads)` for the input `x`, one chunk at a time."""
        x = keras.tree.map_structure(ops.convert_to_tensor, x)
        return self._stream(x)

    def _stream(self, x: Any) -> Iterator[tuple[np.ndarray, list[Any]]]:
        sources = _Sources(self._variables, "variables")
        linearized = _Linearized(self._model, sources, self._compiled, argument=x)
        y = _single_output(linearized)
        check_feature_axis(self._axis, tuple(y.shape))
        axis = self._axis % len(y.shape)
        num_features = int(y.shape[axis])
        broadcast = [1] * len(y.shape)
        broadcast[axis] = num_features
        for start in range(0, num_features, self._chunk_size):
            features = np.arange(start, min(start + self._chunk_size, num_features))
            per_feature = []
            for feature in features:
                selected = ops.reshape(ops.arange(num_features) == int(feature), broadcast)
                cotangent = ops.broadcast_to(ops.cast(selected, y.dtype), tuple(y.shape))
                per_feature.append(linearized.pull_back([cotangent]))
            yield features, [ops.stack(grads) for grads in zip(*per_feature)]
