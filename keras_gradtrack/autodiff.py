"""Gradients, VJPs, JVPs and Jacobians of functions: compiled, exact, memory-bounded.

`grad`, `vjp` and `jvp` are one reverse- or forward-mode pass. `jacobian`,
`batch_jacobian` and `output_gradients` stack vector-Jacobian products over
one-hot cotangents, `chunk_size` of them per forward pass, so peak memory grows
with the chunk and not with the number of outputs.

Each function traces into a `tf.function` (without AutoGraph), reused while `fn`
is the same object and the input shapes, dtypes and Python arguments are unchanged.
`OutputGradients` is the compiled form of `output_gradients`, kept across calls.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "OutputGradients",
    "batch_jacobian",
    "grad",
    "jacobian",
    "jvp",
    "output_gradients",
    "vjp",
]

_CALL_THE_MODEL = (
    "Gradients flow only through TensorFlow operations on the tensors fn receives, "
    "and `model.predict(x)` returns numpy without recording anything on a tape. "
    "Call the model instead: `fn = lambda x: model(x)`."
)
_CUT_GRADIENT_HINT = (
    "Make sure fn computes its output from it with differentiable TensorFlow "
    "operations: integer casts, argmax, `tf.stop_gradient` and numpy round trips "
    "(`.numpy()`, `model.predict`) cut the gradient."
)


def grad(fn: Callable, inputs: Any, grad_outputs: Any = None, *, jit_compile=None) -> Any:
    """Gradient of `fn(inputs)` with respect to `inputs`, like `torch.autograd.grad`.

    Computes `d <grad_outputs, fn(inputs)> / d inputs`; with the default
    `grad_outputs` (ones), the gradient of the sum of every output. Never
    returns `None`: an input the output does not depend on raises a `ValueError`.

    Args:
        fn: Callable taking `inputs` and returning a tensor or a nest of tensors,
            e.g. a Keras model. It must call the model, not `model.predict`
            (numpy, no tape).
        inputs: Floating-point tensor, numpy array or nest of them.
        grad_outputs: `None` (ones) or tensors with the structure and shapes
            of `fn(inputs)`.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        The gradients, with the structure, shapes and dtypes of `inputs`.

    Example:

    ```python
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    x = np.random.rand(4, 3).astype("float32")
    dx = keras_gradtrack.autodiff.grad(model, x)  # d sum(model(x)) / dx, shape (4, 3)
    ```
    """
    inputs = _as_tensors(inputs, "inputs", require_floating=True)
    if grad_outputs is not None:
        grad_outputs = _as_tensors(grad_outputs, "grad_outputs")
    with _explaining_numpy_round_trips(fn, inputs):
        traced = _traced(_vjp_graph, jit_compile)
        return traced(fn, inputs, grad_outputs, "inputs", "grad_outputs")[1]


def vjp(fn: Callable, primals: Any, cotangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """Vector-Jacobian product `cotangents^T J` and `fn(primals)`, in one pass.

    Args:
        fn: Callable taking `primals` and returning a tensor or a nest of tensors.
        primals: Floating-point tensor, numpy array or nest of them.
        cotangents: Tensors with the structure and shapes of `fn(primals)`.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        `(outputs, vjp)`: `fn(primals)`, and `d <cotangents, fn(primals)> / d primals`
        with the structure of `primals`.

    Example:

    ```python
    model = keras.Sequential([keras.Input((1095,)), keras.layers.Dense(8)])
    x = np.random.rand(32, 1095).astype("float32")
    v = np.ones((32, 8), "float32")
    outputs, v_jac = keras_gradtrack.autodiff.vjp(model, x, v)  # v^T J, shape (32, 1095)
    ```
    """
    primals = _as_tensors(primals, "primals", require_floating=True)
    cotangents = _as_tensors(cotangents, "cotangents")
    with _explaining_numpy_round_trips(fn, primals):
        return _traced(_vjp_graph, jit_compile)(fn, primals, cotangents, "primals", "cotangents")


def jvp(fn: Callable, primals: Any, tangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """Jacobian-vector product `J tangents` in forward mode, and `fn(primals)`.

    Uses `tf.autodiff.ForwardAccumulator`: about the cost of one more forward
    pass, whatever the sizes of the inputs and outputs.

    Args:
        fn: Callable taking `primals` and returning a tensor or a nest of tensors.
        primals: Floating-point tensor, numpy array or nest of them.
        tangents: Tensors with the structure and shapes of `primals`.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        `(outputs, jvp)`: `fn(primals)`, and each output's directional derivative
        along `tangents`, with the structure of `outputs`.

    Example:

    ```python
    model = keras.Sequential([keras.Input((1095,)), keras.layers.Dense(8)])
    x = np.random.rand(32, 1095).astype("float32")
    v = np.random.rand(32, 1095).astype("float32")
    outputs, jac_v = keras_gradtrack.autodiff.jvp(model, x, v)  # J v, shape (32, 8)
    ```
    """
    primals = _as_tensors(primals, "primals", require_floating=True)
    tangents = _as_tensors(tangents, "tangents")
    with _explaining_numpy_round_trips(fn, primals):
        return _traced(_jvp_graph, jit_compile)(fn, primals, tangents)


def jacobian(fn: Callable, x: Any, chunk_size: int | None = None, *, jit_compile=None) -> Any:
    """Full Jacobian of `fn(x)`, exact, vectorized `chunk_size` rows at a time.

    Matches `tf.GradientTape.jacobian`: shape `y.shape + x.shape` for `y = fn(x)`.
    After one forward pass, each chunk of rows is one `tf.vectorized_map` over
    one-hot cotangents; chunks run one after another, which bounds the memory
    beyond the result itself.

    Args:
        fn: Callable taking `x` and returning one tensor.
        x: Floating-point tensor, numpy array or nest of them.
        chunk_size: Elements of `y` per vectorized batch of VJPs, or `None` for
            all at once. Need not divide `y`'s size.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        The Jacobian, with the structure of `x`.

    Example:

    ```python
    x = np.random.rand(5, 3)
    jac = keras_gradtrack.autodiff.jacobian(tf.sin, x, chunk_size=4)  # shape (5, 3, 5, 3)
    ```
    """
    x = _as_tensors(x, "x", require_floating=True)
    _check_chunk_size(chunk_size, allow_none=True)
    with _explaining_numpy_round_trips(fn, x):
        return _traced(_jacobian_graph, jit_compile)(fn, x, chunk_size)


def batch_jacobian(
    fn: Callable, x: Any, chunk_size: int | None = None, *, jit_compile=None
) -> tf.Tensor:
    """Per-example Jacobians `d y[i] / d x[i]`, like `tf.GradientTape.batch_jacobian`.

    Assumes that `y[i] = fn(x)[i]` depends on `x[i]` only (no batch normalization
    in training mode, nothing mixing examples). Computed like `jacobian`.

    Args:
        fn: Callable taking `x` and returning one tensor with the batch size of `x`.
        x: Floating-point tensor or numpy array whose first axis is the batch.
        chunk_size: Elements of `y[i]` per vectorized batch of VJPs, or `None`
            for all at once. Need not divide `y[i]`'s size.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        A tensor of shape `(B,) + y.shape[1:] + x.shape[1:]`.

    Example:

    ```python
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(4)])
    x = np.random.rand(8, 10).astype("float32")
    jac = keras_gradtrack.autodiff.batch_jacobian(model, x, chunk_size=3)  # (8, 4, 10)
    ```
    """
    x = _as_tensors(x, "x", require_floating=True)
    if not tf.is_tensor(x):
        raise TypeError(f"`x` must be one tensor. Received: x={_shapes_of(x)}")
    _check_chunk_size(chunk_size, allow_none=True)
    with _explaining_numpy_round_trips(fn, x):
        return _traced(_batch_jacobian_graph, jit_compile)(fn, x, chunk_size)


def output_gradients(
    model: Callable,
    x: Any,
    variables: Any = None,
    axis: int = -1,
    chunk_size: int = 16,
    *,
    jit_compile=None,
) -> Iterator[tuple[np.ndarray, list[tf.Tensor]]]:
    """Streams the gradient of every output feature with respect to the weights.

    For each feature `f` along `axis` of `y = model(x)`, yields
    `d sum(y[..., f, ...]) / d variables[j]`, the sum running over every other
    axis. Each chunk of `chunk_size` features is one compiled call: one forward
    pass, then one backward pass per feature, run one after another so that peak
    memory grows with `chunk_size` and not with the number of features. All
    chunks share one trace (the last is padded; padding costs no backward pass).

    This traces anew on every call; to take output gradients repeatedly (say,
    during training), build an `OutputGradients` once and call it instead.

    Args:
        model: A Keras model, or a callable taking `x` and returning one tensor.
        x: The model's input: tensor, numpy array or nest of them.
        variables: Variables to differentiate; defaults to
            `model.trainable_variables`.
        axis: The output axis that enumerates the features (`-1`: the last;
            `0` would be the batch).
        chunk_size: Features per compiled call.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Returns:
        An iterator of `(feature_indices, grads)`: `feature_indices` is a numpy
        array of the chunk's features and `grads[j]` has shape
        `(len(feature_indices),) + variables[j].shape`.

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((64, 16)),
        keras.layers.Conv1D(32, 3, padding="same", activation="relu"),
        keras.layers.Dense(144),
    ])
    x = np.random.rand(16, 64, 16).astype("float32")
    for features, grads in keras_gradtrack.autodiff.output_gradients(model, x, chunk_size=8):
        kernel_norms = tf.norm(tf.reshape(grads[-2], (len(features), -1)), axis=1)
    ```
    """
    return OutputGradients(model, variables, axis, chunk_size, jit_compile=jit_compile)(x)


class OutputGradients:
    """`output_gradients` compiled once, for repeated use on inputs of one shape.

    Calling it with `x` yields exactly what `output_gradients(model, x, ...)`
    yields. The compiled function is traced on the first call and reused by
    every later call with inputs of the same shapes and dtypes, so a training
    loop can take output gradients every few steps without tracing again. The
    variables are read at every call: their current values are used.

    Args:
        model: A Keras model, or a callable taking `x` and returning one tensor.
        variables: Variables to differentiate; defaults to
            `model.trainable_variables` (the model must be built).
        axis: The output axis that enumerates the features (`-1`: the last;
            `0` would be the batch).
        chunk_size: Features per compiled call.
        jit_compile: Passed to `tf.function`; `True` compiles with XLA.

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((64, 16)),
        keras.layers.Conv1D(32, 3, padding="same", activation="relu"),
        keras.layers.Dense(144),
    ])
    feature_gradients = keras_gradtrack.autodiff.OutputGradients(model, chunk_size=8)
    for step in range(3):
        x = np.random.rand(16, 64, 16).astype("float32")
        for features, grads in feature_gradients(x):  # traced at step 0 only
            kernel_norms = tf.norm(tf.reshape(grads[-2], (len(features), -1)), axis=1)
    ```
    """

    def __init__(
        self,
        model: Callable,
        variables: Any = None,
        axis: int = -1,
        chunk_size: int = 16,
        *,
        jit_compile=None,
    ):
        _check_chunk_size(chunk_size, allow_none=False)
        if variables is None:
            variables = getattr(model, "trainable_variables", None)
        if not variables:
            raise ValueError(
                "There is nothing to differentiate: pass `variables=`, or build the model "
                "(call it once) so that `model.trainable_variables` is not empty. "
                f"Received: variables={variables!r}"
            )
        self._model = model
        self._variables = list(variables)
        self._axis = axis
        self._chunk_size = int(chunk_size)
        self._gradients_of_features = tf.function(
            self._gradients_of_chunk, jit_compile=jit_compile, autograph=False
        )

    @property
    def variables(self) -> list[Any]:
        """The variables differentiated, in the order of each chunk's `grads`."""
        return list(self._variables)

    @property
    def axis(self) -> int:
        """The output axis that enumerates the features, as given."""
        return self._axis

    @property
    def chunk_size(self) -> int:
        """Features per compiled call."""
        return self._chunk_size

    def __call__(self, x: Any) -> Iterator[tuple[np.ndarray, list[tf.Tensor]]]:
        """Streams `(feature_indices, grads)` for the input `x`, one chunk at a time.

        Args:
            x: The model's input: tensor, numpy array or nest of them.

        Returns:
            An iterator of `(feature_indices, grads)`, as `output_gradients` returns.
        """
        return self._stream(_as_tensors(x, "x"))

    def _stream(self, x):
        chunk_size = self._chunk_size
        # The number of features is known once the first chunk has run.
        start, num_features = 0, chunk_size
        while start < num_features:
            # Indices past the last feature select nothing: all-zero cotangents.
            feature_indices = np.arange(start, start + chunk_size)
            with _explaining_numpy_round_trips(self._model, x):
                grads, num_features = self._gradients_of_features(
                    x, tf.constant(feature_indices, tf.int32)
                )
            num_valid = min(chunk_size, int(num_features) - start)
            if num_valid < chunk_size:
                feature_indices = feature_indices[:num_valid]
                grads = [g[:num_valid] for g in grads]
            yield feature_indices, grads
            start += chunk_size

    def _gradients_of_chunk(self, x, feature_indices):
        with tf.GradientTape() as tape:
            # Trainable variables are watched anyway; this covers the others. A
            # Keras variable is watched through the tf.Variable it wraps.
            tape.watch([v.value if isinstance(v, keras.Variable) else v for v in self._variables])
            y = self._model(x)
        _check_single_output(y)
        rank, axis = y.shape.rank, self._axis
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis` must select the feature axis of the model output, which has shape "
                f"{tuple(y.shape)} (axes -{rank}..{rank - 1}; axis 0 is the batch). "
                f"Received: axis={axis}"
            )
        axis %= rank
        # One backward pass at a time rather than vectorized over the chunk: on CPU
        # it took no more time and 20-40% less memory (docs/autodiff.md).
        grads = _basis_vjps(tape, y, self._variables, (axis,), feature_indices, "variables", False)
        return grads, tf.constant(y.shape[axis])


def _vjp_graph(fn, primals, cotangents, primals_name, cotangents_name):
    with tf.GradientTape() as tape:
        tape.watch(primals)
        outputs = fn(primals)
    _check_tensor_outputs(outputs)
    if cotangents is not None:
        cotangents = _matched_to(cotangents, outputs, cotangents_name, "fn's output")
    vjps = tape.gradient(tf.nest.flatten(outputs), primals, output_gradients=cotangents)
    _check_connected(primals, vjps, primals_name)
    return outputs, vjps


def _jvp_graph(fn, primals, tangents):
    tangents = _matched_to(tangents, primals, "tangents", "primals")
    with tf.autodiff.ForwardAccumulator(tf.nest.flatten(primals), tangents) as accumulator:
        outputs = fn(primals)
    _check_tensor_outputs(outputs)
    jvps = tf.nest.map_structure(accumulator.jvp, outputs)
    for name, output_jvp in _named_leaves(jvps, "fn's output"):
        if output_jvp is None:
            raise ValueError(
                f"{name} does not depend on any of the primals, so its directional "
                f"derivative is undefined (TensorFlow returns None). {_CUT_GRADIENT_HINT}"
            )
    return outputs, jvps


def _jacobian_graph(fn, x, chunk_size):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    _check_single_output(y)
    rows = _chunked_basis_vjps(tape, y, x, tuple(range(y.shape.rank)), chunk_size)
    return tf.nest.map_structure(
        lambda row, source: tf.reshape(row, tf.concat([tf.shape(y), tf.shape(source)], 0)),
        rows,
        x,
    )


def _batch_jacobian_graph(fn, x, chunk_size):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    _check_single_output(y)
    if y.shape.rank == 0 or not y.shape[:1].is_compatible_with(x.shape[:1]):
        raise ValueError(
            "batch_jacobian needs fn(x) to keep the batch axis of x. "
            f"Received: x.shape={tuple(x.shape)}, fn(x).shape={tuple(y.shape)}"
        )
    # rows[k, i] = d y[i, k] / d x[i], with k running over y[i] flattened.
    rows = _chunked_basis_vjps(tape, y, x, tuple(range(1, y.shape.rank)), chunk_size)
    rows = tf.transpose(rows, [1, 0, *range(2, x.shape.rank + 1)])
    return tf.reshape(rows, tf.concat([tf.shape(y), tf.shape(x)[1:]], 0))


def _chunked_basis_vjps(tape, y, sources, axes, chunk_size):
    """`_basis_vjps` for every index of `axes`, vectorized `chunk_size` at a time."""
    num_rows = math.prod(y.shape[axis] for axis in axes)
    chunk_size = num_rows if chunk_size is None else min(chunk_size, num_rows)
    num_chunks = -(-num_rows // chunk_size)
    flat_sources = tf.nest.flatten(sources)
    chunks = _map_fn(
        lambda start: _basis_vjps(
            tape, y, flat_sources, axes, start + tf.range(chunk_size), "x", True
        ),
        tf.range(num_chunks) * chunk_size,
        fn_output_signature=[tf.TensorSpec((chunk_size, *s.shape), s.dtype) for s in flat_sources],
        parallel_iterations=1,  # One chunk in flight bounds the memory.
    )
    rows = [
        tf.reshape(chunk, tf.concat([[num_chunks * chunk_size], tf.shape(source)], 0))[:num_rows]
        for chunk, source in zip(chunks, flat_sources)
    ]
    return tf.nest.pack_sequence_as(sources, rows)


def _basis_vjps(tape, y, sources, axes, indices, sources_name, vectorized):
    """Stacks `d sum(y[..., i, ...]) / d sources` for each `i` of `indices`.

    `i` indexes the elements of `y` along `axes` (flattened in row-major order);
    the sum runs over the other axes. Indices past the end give zeros (computed
    by the vectorized map, skipped by the sequential one).
    """
    sizes = [y.shape[axis] if axis in axes else 1 for axis in range(y.shape.rank)]
    if None in sizes:
        raise ValueError(f"The output axes {axes} must have static sizes. Received: {y.shape}")
    num_rows = math.prod(sizes)

    def vjp_of_basis_cotangent(index):
        one_hot = tf.one_hot(index, num_rows, dtype=y.dtype)
        cotangent = tf.broadcast_to(tf.reshape(one_hot, sizes), tf.shape(y))
        vjps = tape.gradient(y, sources, output_gradients=cotangent)
        _check_connected(sources, vjps, sources_name)
        return vjps

    if vectorized:
        return tf.vectorized_map(vjp_of_basis_cotangent, indices)

    def vjp_unless_past_the_end(index):
        zeros = [tf.zeros(s.shape, s.dtype) for s in sources]
        return tf.cond(index < num_rows, lambda: vjp_of_basis_cotangent(index), lambda: zeros)

    signature = [tf.TensorSpec(s.shape, s.dtype) for s in sources]
    return _map_fn(
        vjp_unless_past_the_end, indices, fn_output_signature=signature, parallel_iterations=1
    )


def _map_fn(fn, elems, **kwargs):
    """`tf.map_fn` that leaves the variable scope as it found it, even when `fn` raises.

    `tf.map_fn` sets a caching device on the current variable scope and resets it
    only on success; left set, it breaks every later `tf.distribute` strategy
    scope in the process ("Caching devices is not yet supported when eager
    execution is enabled").
    """
    scope = tf.compat.v1.get_variable_scope()
    caching_device = scope.caching_device
    try:
        return tf.map_fn(fn, elems, **kwargs)
    finally:
        scope.set_caching_device(caching_device)


@functools.cache
def _traced(graph_function, jit_compile):
    # `fn` is an argument of the traced function: tf.function keys its traces on
    # a weak reference to it, so passing the same fn again reuses the trace.
    return tf.function(graph_function, jit_compile=jit_compile, autograph=False)


@contextlib.contextmanager
def _explaining_numpy_round_trips(fn, inputs):
    """Turns the tracing error of a fn that goes through numpy into a clear one.

    Symbolic tensors have no `.numpy()`, so `model.predict` fails while being
    traced with an AttributeError or NotImplementedError. Calling fn eagerly
    tells that case (fn returns numpy) apart from other errors.
    """
    try:
        yield
    except (AttributeError, NotImplementedError) as error:
        if tf.executing_eagerly():
            try:
                outputs = fn(inputs)
            except Exception:
                raise error from None
            _check_tensor_outputs(outputs, cause=error)
        raise


def _check_tensor_outputs(outputs, cause=None):
    for name, leaf in _named_leaves(outputs, "fn's output"):
        if not tf.is_tensor(leaf):
            if isinstance(leaf, np.ndarray | np.generic):
                received = f"a numpy array of shape {np.shape(leaf)}"
            else:
                received = f"a {type(leaf).__name__}"
            message = f"fn must return tensors, but {name} is {received}. {_CALL_THE_MODEL}"
            raise TypeError(message) from cause


def _check_single_output(y):
    _check_tensor_outputs(y)
    if not tf.is_tensor(y):
        raise TypeError(
            "fn must return one tensor (e.g. `lambda x: model(x)[0]` for a model with "
            f"several outputs). Received outputs with shapes {_shapes_of(y)}"
        )


def _check_connected(sources, gradients, sources_name):
    named_sources = _named_leaves(sources, sources_name)
    for (name, source), gradient in zip(named_sources, tf.nest.flatten(gradients)):
        if gradient is None:
            path = f"'{source.path}', " if hasattr(source, "path") else ""
            raise ValueError(
                f"fn's output does not depend on {name} ({path}shape {tuple(source.shape)}), "
                f"so its gradient is undefined (TensorFlow returns None). {_CUT_GRADIENT_HINT}"
            )


def _check_chunk_size(chunk_size, allow_none):
    if chunk_size is None and allow_none:
        return
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int | np.integer)
        or chunk_size < 1
    ):
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"`chunk_size` must be {expected}. Received: chunk_size={chunk_size!r}")


def _as_tensors(structure, name, require_floating=False):
    tensors = []
    for leaf_name, leaf in _named_leaves(structure, name):
        tensor = tf.convert_to_tensor(leaf)
        if require_floating and not (tensor.dtype.is_floating or tensor.dtype.is_complex):
            raise TypeError(
                f"Gradients are defined for floating-point inputs only, but {leaf_name} has "
                f"dtype {tensor.dtype.name}. Cast it first, e.g. `tf.cast(x, 'float32')`."
            )
        tensors.append(tensor)
    return keras.tree.pack_sequence_as(structure, tensors)


def _matched_to(values, reference, name, reference_name):
    """Flattens `values`, checked against `reference`'s structure and shapes, in its dtypes."""
    try:
        tf.nest.assert_same_structure(values, reference, check_types=False)
    except (ValueError, TypeError):
        raise ValueError(
            f"`{name}` must have the structure of {reference_name}, {_shapes_of(reference)}. "
            f"Received: {name}={_shapes_of(values)}"
        ) from None
    matched = []
    for (value_name, value), ref in zip(_named_leaves(values, name), tf.nest.flatten(reference)):
        if not value.shape.is_compatible_with(ref.shape):
            raise ValueError(
                f"`{value_name}` must have the shape of {reference_name}, {tuple(ref.shape)}. "
                f"Received: shape {tuple(value.shape)}"
            )
        matched.append(tf.cast(value, ref.dtype))
    return matched


def _named_leaves(structure, name) -> list[tuple[str, Any]]:
    return [
        (name + "".join(f"[{key!r}]" for key in path), leaf)
        for path, leaf in keras.tree.flatten_with_path(structure)
    ]


def _shapes_of(structure):
    return keras.tree.map_structure(
        lambda leaf: tuple(leaf.shape) if hasattr(leaf, "shape") else type(leaf).__name__,
        structure,
    )
