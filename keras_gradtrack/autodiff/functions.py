"""`grad`, `vjp`, `jvp`, `jacobian` and `batch_jacobian`: one compiled function each."""

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_gradtrack.autodiff.arguments import check_chunk_size, named_leaves, shapes_of
from keras_gradtrack.autodiff.basis import chunked_basis_vjps
from keras_gradtrack.autodiff.checks import (
    CUT_GRADIENT_HINT,
    as_sources,
    as_tensors,
    check_connected,
    check_single_output,
    check_tensor_outputs,
    explaining_numpy_round_trips,
    matched_to,
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
        inputs: Floating-point tensor, numpy array, variable or nest of them. A
            variable is differentiated as itself, however fn reads it: pass
            `model.trainable_variables` as torch users pass `model.parameters()`.
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
    loss = lambda weights: keras.ops.mean(model(x) ** 2)  # reads the weights via the model
    dw = keras_gradtrack.autodiff.grad(loss, model.trainable_variables)  # [(3, 2), (2,)]
    ```
    """
    inputs = as_sources(inputs, "inputs")
    if grad_outputs is not None:
        grad_outputs = as_tensors(grad_outputs, "grad_outputs")
    with explaining_numpy_round_trips(fn, inputs):
        traced = traced_graph(_vjp_graph, jit_compile)
        return traced(fn, inputs, grad_outputs, "inputs", "grad_outputs")[1]


def vjp(fn: Callable, primals: Any, cotangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """Vector-Jacobian product `cotangents^T J` and `fn(primals)`, in one pass.

    Args:
        fn: Callable taking `primals` and returning a tensor or a nest of tensors.
        primals: Floating-point tensor, numpy array, variable or nest of them
            (a variable is differentiated as itself, as in `grad`).
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
    primals = as_sources(primals, "primals")
    cotangents = as_tensors(cotangents, "cotangents")
    with explaining_numpy_round_trips(fn, primals):
        return traced_graph(_vjp_graph, jit_compile)(
            fn, primals, cotangents, "primals", "cotangents"
        )


def jvp(fn: Callable, primals: Any, tangents: Any, *, jit_compile=None) -> tuple[Any, Any]:
    """Jacobian-vector product `J tangents` in forward mode, and `fn(primals)`.

    Uses `tf.autodiff.ForwardAccumulator`: about the cost of one more forward
    pass, whatever the sizes of the inputs and outputs.

    Args:
        fn: Callable taking `primals` and returning a tensor or a nest of tensors.
        primals: Floating-point tensor, numpy array, variable or nest of them
            (a variable is differentiated as itself, as in `grad`).
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
    primals = as_sources(primals, "primals")
    tangents = as_tensors(tangents, "tangents")
    with explaining_numpy_round_trips(fn, primals):
        return traced_graph(_jvp_graph, jit_compile)(fn, primals, tangents)


def jacobian(fn: Callable, x: Any, chunk_size: int | None = None, *, jit_compile=None) -> Any:
    """Full Jacobian of `fn(x)`, exact, vectorized `chunk_size` rows at a time.

    Matches `tf.GradientTape.jacobian`: shape `y.shape + x.shape` for `y = fn(x)`.
    After one forward pass, each chunk of rows is one `tf.vectorized_map` over
    one-hot cotangents; chunks run one after another, which bounds the memory
    beyond the result itself.

    Args:
        fn: Callable taking `x` and returning one tensor.
        x: Floating-point tensor, numpy array, variable or nest of them (a
            variable is differentiated as itself, as in `grad`).
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
    x = as_sources(x, "x")
    check_chunk_size(chunk_size, allow_none=True)
    with explaining_numpy_round_trips(fn, x):
        return traced_graph(_jacobian_graph, jit_compile)(fn, x, chunk_size)


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
    x = as_sources(x, "x")
    if not tf.is_tensor(x):
        raise TypeError(f"`x` must be one tensor. Received: x={shapes_of(x)}")
    check_chunk_size(chunk_size, allow_none=True)
    with explaining_numpy_round_trips(fn, x):
        return traced_graph(_batch_jacobian_graph, jit_compile)(fn, x, chunk_size)


def _vjp_graph(fn, primals, cotangents, primals_name, cotangents_name):
    with tf.GradientTape() as tape:
        tape.watch(primals)
        outputs = fn(primals)
    check_tensor_outputs(outputs)
    if cotangents is not None:
        cotangents = matched_to(cotangents, outputs, cotangents_name, "fn's output")
    vjps = tape.gradient(tf.nest.flatten(outputs), primals, output_gradients=cotangents)
    check_connected(primals, vjps, primals_name)
    return outputs, vjps


def _jvp_graph(fn, primals, tangents):
    tangents = matched_to(tangents, primals, "tangents", "primals")
    with tf.autodiff.ForwardAccumulator(tf.nest.flatten(primals), tangents) as accumulator:
        outputs = fn(primals)
    check_tensor_outputs(outputs)
    jvps = tf.nest.map_structure(accumulator.jvp, outputs)
    for name, output_jvp in named_leaves(jvps, "fn's output"):
        if output_jvp is None:
            raise ValueError(
                f"{name} does not depend on any of the primals, so its directional "
                f"derivative is undefined (TensorFlow returns None). {CUT_GRADIENT_HINT}"
            )
    return outputs, jvps


def _jacobian_graph(fn, x, chunk_size):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    check_single_output(y)
    rows = chunked_basis_vjps(tape, y, x, tuple(range(y.shape.rank)), chunk_size)
    return tf.nest.map_structure(
        lambda row, source: tf.reshape(row, tf.concat([tf.shape(y), tf.shape(source)], 0)),
        rows,
        x,
    )


def _batch_jacobian_graph(fn, x, chunk_size):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    check_single_output(y)
    if y.shape.rank == 0 or not y.shape[:1].is_compatible_with(x.shape[:1]):
        raise ValueError(
            "batch_jacobian needs fn(x) to keep the batch axis of x. "
            f"Received: x.shape={tuple(x.shape)}, fn(x).shape={tuple(y.shape)}"
        )
    # rows[k, i] = d y[i, k] / d x[i], with k running over y[i] flattened.
    rows = chunked_basis_vjps(tape, y, x, tuple(range(1, y.shape.rank)), chunk_size)
    rows = tf.transpose(rows, [1, 0, *range(2, x.shape.rank + 1)])
    return tf.reshape(rows, tf.concat([tf.shape(y), tf.shape(x)[1:]], 0))


@functools.cache
def traced_graph(graph_function, jit_compile):
    """One `tf.function` of `graph_function(fn, sources, *args)` for the process,
    called as `traced(fn, sources, *args)`: a trace is reused for the same `fn`
    (weakly held), the same variables among `sources` and the same shapes."""

    # `fn` is an argument of the traced function: tf.function keys its traces on
    # a weak reference to it, so passing the same fn again reuses the trace.
    # Variables among the sources are arguments too, but keyed on shape and dtype
    # alone: a trace made for some variables would run on others of the same
    # shapes, wrong where fn reads the first ones directly (through a model).
    # Their identities, passed as a Python value, give each set its own trace.
    def keyed_by_variables(variable_ids, fn, sources, *args):
        del variable_ids
        return graph_function(fn, sources, *args)

    traced = tf.function(keyed_by_variables, jit_compile=jit_compile, autograph=False)

    def call(fn, sources, *args):
        flat_sources = tf.nest.flatten(sources)
        variable_ids = tuple(id(s) for s in flat_sources if isinstance(s, tf.Variable))
        return traced(variable_ids, fn, sources, *args)

    return call
