"""`keras_gradtrack.autodiff` on JAX and PyTorch (each backend's test module imports
these): every function against the closed form of a two-layer tanh network in numpy
(gradients, VJPs, JVPs, Jacobians, per-feature weight gradients, with respect to
inputs and to variables read through the model), a convolutional model's per-feature
gradients against the backend's own autodiff, and the arguments refused as on
TensorFlow. TensorFlow's are `test_autodiff.py`."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import keras
import numpy as np
import pytest
from keras import ops
from output_gradient_cases import PROBE, feature_gradients, generator

from keras_gradtrack import autodiff

RNG = np.random.default_rng(2)
X = RNG.normal(size=(3, 4)).astype("float32")
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def numpy_of(structure: Any) -> Any:
    return keras.tree.map_structure(ops.convert_to_numpy, structure)


class Network:
    """`y = tanh(x W1 + b1) W2 + b2` as a Keras model, and its derivatives in numpy."""

    def __init__(self) -> None:
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="tanh", bias_initializer="glorot_uniform")(inputs)
        self.model = keras.Model(inputs, keras.layers.Dense(2, bias_initializer="ones")(hidden))
        self.w1, self.b1, self.w2, self.b2 = numpy_of(self.model.trainable_variables)
        self.h = np.tanh(X @ self.w1 + self.b1)
        self.slope = 1 - self.h**2  # tanh' at the pre-activation, (B, 5)

    def batch_jacobian(self) -> np.ndarray:
        """`d y[b, o] / d x[b, i]`, (B, 2, 4)."""
        return np.einsum("jo,bj,ij->boi", self.w2, self.slope, self.w1)

    def weight_gradients(self, cotangent: np.ndarray) -> list[np.ndarray]:
        """`d <cotangent, y> / d (W1, b1, W2, b2)`."""
        back = (cotangent @ self.w2.T) * self.slope
        return [X.T @ back, back.sum(0), self.h.T @ cotangent, cotangent.sum(0)]


@pytest.mark.parametrize("with_cotangent", [False, True])
def test_grad_of_the_input_is_the_closed_form(with_cotangent: bool) -> None:
    net = Network()
    cotangent = RNG.normal(size=(3, 2)).astype("float32")
    weights = cotangent if with_cotangent else np.ones((3, 2), "float32")
    expected = np.einsum("boi,bo->bi", net.batch_jacobian(), weights)
    found = autodiff.grad(net.model, X, cotangent if with_cotangent else None)
    np.testing.assert_allclose(ops.convert_to_numpy(found), expected, **TOLERANCE)


def test_grad_of_variables_read_through_the_model_is_the_closed_form() -> None:
    net = Network()
    variables = net.model.trainable_variables
    before = numpy_of(variables)
    found = autodiff.grad(lambda _: ops.sum(net.model(X)[:, 1]), variables)
    cotangent = np.zeros((3, 2), "float32")
    cotangent[:, 1] = 1
    for got, expected in zip(numpy_of(found), net.weight_gradients(cotangent)):
        np.testing.assert_allclose(got, expected, **TOLERANCE)
    for after, kept in zip(numpy_of(variables), before):
        np.testing.assert_array_equal(after, kept)


def test_a_non_trainable_variable_is_differentiated_too() -> None:
    inputs = keras.Input((4,))
    norm = keras.layers.BatchNormalization(center=False, scale=False, epsilon=0.0)
    model = keras.Model(inputs, norm(inputs))
    norm.moving_variance.assign(np.full(4, 4.0, "float32"))
    (found,) = autodiff.grad(lambda _: ops.sum(model(X, training=False)), [norm.moving_mean])
    np.testing.assert_allclose(ops.convert_to_numpy(found), np.full(4, -3 / 2), **TOLERANCE)


def test_vjp_and_jvp_are_the_closed_form_with_nested_inputs() -> None:
    net = Network()
    split = {"left": X[:, :2], "right": X[:, 2:]}

    def joined(inputs: dict[str, Any]) -> Any:
        return net.model(ops.concatenate([inputs["left"], inputs["right"]], axis=1))

    jacobian = net.batch_jacobian()
    cotangent = RNG.normal(size=(3, 2)).astype("float32")
    outputs, pulled = autodiff.vjp(joined, split, cotangent)
    back = np.einsum("boi,bo->bi", jacobian, cotangent)
    np.testing.assert_allclose(ops.convert_to_numpy(pulled["left"]), back[:, :2], **TOLERANCE)
    np.testing.assert_allclose(ops.convert_to_numpy(pulled["right"]), back[:, 2:], **TOLERANCE)
    tangent = RNG.normal(size=(3, 4)).astype("float32")
    tangents = {"left": tangent[:, :2], "right": tangent[:, 2:]}
    outputs_forward, pushed = autodiff.jvp(joined, split, tangents)
    expected = np.einsum("boi,bi->bo", jacobian, tangent)
    np.testing.assert_allclose(ops.convert_to_numpy(pushed), expected, **TOLERANCE)
    for found in (outputs, outputs_forward):
        np.testing.assert_allclose(ops.convert_to_numpy(found), numpy_of(net.model(X)), **TOLERANCE)


def test_jvp_along_a_variable_is_the_closed_form() -> None:
    net = Network()
    tangent = RNG.normal(size=net.w1.shape).astype("float32")
    kernel = net.model.trainable_variables[0]
    _, pushed = autodiff.jvp(lambda _: net.model(X), [kernel], [tangent])
    expected = ((X @ tangent) * net.slope) @ net.w2
    np.testing.assert_allclose(ops.convert_to_numpy(pushed), expected, **TOLERANCE)


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_jacobians_are_the_closed_form_in_chunks(chunk_size: int | None) -> None:
    net = Network()
    expected = net.batch_jacobian()
    per_example = autodiff.batch_jacobian(net.model, X, chunk_size=chunk_size)
    np.testing.assert_allclose(ops.convert_to_numpy(per_example), expected, **TOLERANCE)
    full = ops.convert_to_numpy(autodiff.jacobian(net.model, X, chunk_size=chunk_size))
    assert full.shape == (3, 2, 3, 4)
    for b in range(3):
        for other in range(3):
            block = expected[b] if b == other else np.zeros((2, 4))
            np.testing.assert_allclose(full[b, :, other], block, **TOLERANCE)


@pytest.mark.parametrize("chunk_size", [1, 2, 16])
def test_output_gradients_are_the_closed_form_per_feature(chunk_size: int) -> None:
    net = Network()
    chunks = list(autodiff.output_gradients(net.model, X, chunk_size=chunk_size))
    features = np.concatenate([f for f, _ in chunks])
    np.testing.assert_array_equal(features, [0, 1])
    stacked = [np.concatenate(parts) for parts in zip(*[numpy_of(g) for _, g in chunks])]
    for feature in range(2):
        cotangent = np.zeros((3, 2), "float32")
        cotangent[:, feature] = 1
        for got, expected in zip(stacked, net.weight_gradients(cotangent)):
            np.testing.assert_allclose(got[feature], expected, **TOLERANCE)


def test_output_gradients_of_a_convolutional_model_equal_the_backends_autodiff() -> None:
    model = generator()
    expected = feature_gradients(model, PROBE)
    gradients = autodiff.OutputGradients(model, chunk_size=4)
    for _ in range(2):  # called again on the same object
        found = [numpy_of(grads) for _, grads in gradients(PROBE)]
        per_feature = [list(per) for chunk in found for per in zip(*chunk)]
        assert len(per_feature) == 10
        for got, oracle in zip(per_feature, expected):
            for g, e in zip(got, oracle):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_the_arguments_are_refused_as_on_tensorflow() -> None:
    net = Network()
    with pytest.raises(ValueError, match="eagerly"):
        autodiff.grad(lambda x: net.model(x), X, jit_compile=True)
    with pytest.raises(ValueError, match="eagerly"):
        autodiff.OutputGradients(lambda x: net.model(x), variables=[X], jit_compile=True)
    with pytest.raises(TypeError, match="floating-point inputs only"):
        autodiff.grad(net.model, X.astype("int32"))
    with pytest.raises(TypeError, match=r"fn must return tensors.*Call the model instead"):
        autodiff.grad(lambda x: np.zeros((3, 2), "float32"), X)
    # JAX refuses the round trip itself; PyTorch cuts the gradient there.
    with pytest.raises((TypeError, ValueError), match="numpy"):
        autodiff.grad(lambda x: net.model(np.asarray(ops.convert_to_numpy(x))), X)
    with pytest.raises(ValueError, match="`cotangents` must have the shape"):
        autodiff.vjp(net.model, X, np.ones((3, 3), "float32"))
    with pytest.raises(ValueError, match="`chunk_size` must be"):
        autodiff.jacobian(net.model, X, chunk_size=0)
    with pytest.raises(ValueError, match="keep the batch axis"):
        autodiff.batch_jacobian(lambda x: ops.sum(net.model(x), axis=0), X)
    with pytest.raises(TypeError, match="must return one tensor"):
        autodiff.jacobian(lambda x: [net.model(x), x], X)
    with pytest.raises(ValueError, match="axis 0 is the batch"):
        autodiff.OutputGradients(net.model, axis=0)


def test_an_input_the_output_does_not_depend_on() -> None:
    net = Network()

    def first(inputs: list[Any]) -> Any:
        return net.model(inputs[0])

    other = np.ones((2,), "float32")
    if keras.backend.backend() == "jax":  # JAX cannot tell it from a zero gradient
        found = autodiff.grad(first, [X, other])
        np.testing.assert_array_equal(ops.convert_to_numpy(found[1]), 0.0)
    else:
        with pytest.raises(ValueError, match=r"does not depend on inputs\[1\]"):
            autodiff.grad(first, [X, other])


class CountedDense(keras.layers.Dense):
    """A Dense layer that counts its calls: each one a trace when its model is compiled."""

    calls = 0

    def call(self, inputs: Any) -> Any:
        CountedDense.calls += 1
        return super().call(inputs)


def test_a_model_is_compiled_once_on_jax_and_reads_its_current_weights() -> None:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, CountedDense(2)(inputs))
    kernel = model.trainable_variables[0]
    CountedDense.calls = 0
    for scale in (1.0, 2.0, -3.0):
        kernel.assign(np.full((4, 2), scale, "float32"))
        found = autodiff.grad(model, X)  # d sum(x K) / dx = K 1: each row 2 * scale
        np.testing.assert_allclose(ops.convert_to_numpy(found), np.full((3, 4), 2 * scale))
        eager = autodiff.grad(model, X, jit_compile=False)
        np.testing.assert_allclose(ops.convert_to_numpy(eager), np.full((3, 4), 2 * scale))
    # JAX: one trace of the compiled call and three eager calls; PyTorch: six eager calls.
    assert CountedDense.calls == (4 if keras.backend.backend() == "jax" else 6)
    gradients = autodiff.OutputGradients(model, chunk_size=2)
    for x in (X, 2 * X + 1):  # d sum(y[:, f]) / dK: x summed over the batch in column f
        ((features, (kernel_gradients, _)),) = list(gradients(x))
        np.testing.assert_array_equal(features, [0, 1])
        for f in features:
            expected = np.zeros((4, 2), "float32")
            expected[:, f] = x.sum(0)
            np.testing.assert_allclose(
                ops.convert_to_numpy(kernel_gradients[f]), expected, rtol=1e-6
            )
    assert CountedDense.calls == (5 if keras.backend.backend() == "jax" else 8)


def test_a_model_differentiated_is_not_kept_alive() -> None:
    """The compiled calls kept per model (JAX) hold it weakly: a model the user drops
    is collected, with its variables."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    autodiff.vjp(model, X, np.ones((3, 2), "float32"))
    list(autodiff.OutputGradients(model, chunk_size=1)(X))
    dropped = weakref.ref(model)
    kernel = weakref.ref(model.trainable_variables[0])
    del model, inputs
    gc.collect()
    assert dropped() is None
    assert kernel() is None
