"""keras_gradtrack.autodiff against TensorFlow's own autodiff, in float64."""

import gc
import weakref
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_gradtrack import autodiff

RTOL = 1e-5


def dense_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


def conv_model(num_features=7):
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((9, 4), dtype="float64"),
            keras.layers.Conv1D(6, 3, padding="same", activation="tanh", dtype="float64"),
            keras.layers.Conv1D(5, 2, activation="relu", dtype="float64"),
            keras.layers.Dense(num_features, dtype="float64"),
        ]
    )


def random(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


def assert_all_close(actual, expected):
    tf.nest.assert_same_structure(actual, expected)
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=1e-12)


# TensorFlow's reference computations, eager.


def tape_vjp(fn, primals, cotangents=None):
    primals = tf.nest.map_structure(tf.constant, primals)
    with tf.GradientTape() as tape:
        tape.watch(primals)
        outputs = fn(primals)
    return tape.gradient(outputs, primals, output_gradients=cotangents)


def accumulator_jvp(fn, primals, tangents):
    primals = tf.nest.map_structure(tf.constant, primals)
    flat_tangents = [tf.constant(t) for t in tf.nest.flatten(tangents)]
    with tf.autodiff.ForwardAccumulator(tf.nest.flatten(primals), flat_tangents) as acc:
        outputs = fn(primals)
    return tf.nest.map_structure(acc.jvp, outputs)


def tape_jacobian(fn, x, batch=False):
    x = tf.nest.map_structure(tf.constant, x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return tape.batch_jacobian(y, x) if batch else tape.jacobian(y, x)


def per_feature_tape_loop(model, x, variables, axis=-1):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([v.value for v in variables])  # Keras variables wrap a tf.Variable.
        y = model(x)
        per_feature_sums = tf.unstack(tf.reduce_sum(y, axis=[a for a in range(3) if a != axis % 3]))
    return [tape.gradient(feature_sum, variables) for feature_sum in per_feature_sums]


# Every function against the reference.

GRAD_CASES = {
    "dense": (lambda: dense_model(), lambda: random(6, 5)),
    "conv": (lambda: conv_model(), lambda: random(3, 9, 4)),
    "list": (
        lambda: lambda xs: tf.sin(xs[0]) @ xs[1],
        lambda: [random(4, 3), random(3, 2, seed=1)],
    ),
    "dict": (
        lambda: lambda d: [d["a"] * tf.exp(d["b"]), tf.reduce_sum(d["a"])],
        lambda: {"a": random(2, 3), "b": random(2, 3, seed=1)},
    ),
}


@pytest.mark.parametrize("case", GRAD_CASES)
def test_grad_matches_tape_gradient(case):
    make_fn, make_inputs = GRAD_CASES[case]
    fn, inputs = make_fn(), make_inputs()
    assert_all_close(autodiff.grad(fn, inputs), tape_vjp(fn, inputs))


@pytest.mark.parametrize("case", ["dense", "list", "dict"])
def test_grad_with_grad_outputs_matches_tape_gradient(case):
    make_fn, make_inputs = GRAD_CASES[case]
    fn, inputs = make_fn(), make_inputs()
    outputs = fn(tf.nest.map_structure(tf.constant, inputs))
    grad_outputs = tf.nest.map_structure(lambda y: random(*y.shape, seed=3), outputs)
    expected = tape_vjp(fn, inputs, tf.nest.flatten(grad_outputs))
    assert_all_close(autodiff.grad(fn, inputs, grad_outputs), expected)


def test_vjp_returns_outputs_and_matches_tape_gradient():
    model = conv_model()
    fn = lambda xs: (model(xs[0]) * xs[1], tf.reduce_mean(xs[0], axis=1))  # noqa: E731
    primals = [random(2, 9, 4), random(2, 8, 7, seed=1)]
    cotangents = (random(2, 8, 7, seed=2), random(2, 4, seed=3))
    outputs, vjp = autodiff.vjp(fn, primals, cotangents)
    assert_all_close(outputs, fn([tf.constant(p) for p in primals]))
    assert_all_close(vjp, tape_vjp(fn, primals, list(cotangents)))


@pytest.mark.parametrize("case", GRAD_CASES)
def test_jvp_matches_forward_accumulator(case):
    make_fn, make_inputs = GRAD_CASES[case]
    fn, primals = make_fn(), make_inputs()
    tangents = tf.nest.map_structure(lambda p: random(*p.shape, seed=4), primals)
    outputs, jvp = autodiff.jvp(fn, primals, tangents)
    assert_all_close(outputs, fn(tf.nest.map_structure(tf.constant, primals)))
    assert_all_close(jvp, accumulator_jvp(fn, primals, tangents))


JACOBIAN_CASES = {
    "dense": (lambda: dense_model(), lambda: random(3, 5)),
    "conv": (lambda: conv_model(), lambda: random(2, 9, 4)),
    "elementwise": (lambda: tf.sin, lambda: random(5, 3)),
    "scalar_output": (lambda: lambda x: tf.reduce_sum(x**3), lambda: random(4, 2)),
}


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("case", JACOBIAN_CASES)
def test_jacobian_matches_tape_jacobian(case, chunk_size):
    make_fn, make_x = JACOBIAN_CASES[case]
    fn, x = make_fn(), make_x()
    jacobian = autodiff.jacobian(fn, x, chunk_size=chunk_size)
    assert_all_close(jacobian, tape_jacobian(fn, x))


@pytest.mark.parametrize("chunk_size", [1, 1000])
def test_jacobian_with_extreme_chunk_sizes_matches_tape_jacobian(chunk_size):
    fn, x = dense_model(), random(3, 5)
    assert_all_close(autodiff.jacobian(fn, x, chunk_size=chunk_size), tape_jacobian(fn, x))


def test_jacobian_of_several_inputs_matches_tape_jacobian():
    fn = lambda xs: tf.tanh(xs[0] @ xs[1])  # noqa: E731
    x = [random(3, 2), random(2, 4, seed=1)]
    assert_all_close(autodiff.jacobian(fn, x, chunk_size=5), tape_jacobian(fn, x))


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("case", ["dense", "conv"])
def test_batch_jacobian_matches_tape_batch_jacobian(case, chunk_size):
    make_fn, make_x = JACOBIAN_CASES[case]
    fn, x = make_fn(), make_x()
    jacobian = autodiff.batch_jacobian(fn, x, chunk_size=chunk_size)
    assert_all_close(jacobian, tape_jacobian(fn, x, batch=True))


@pytest.mark.parametrize("jit_compile", [None, True])
def test_output_gradients_match_per_feature_tape_loop(jit_compile):
    model, x = conv_model(num_features=7), random(3, 9, 4)
    variables = model.trainable_variables
    chunks = list(autodiff.output_gradients(model, x, chunk_size=3, jit_compile=jit_compile))
    assert [list(features) for features, _ in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    per_feature = [
        [grads[j][k] for j in range(len(variables))]
        for _, grads in chunks
        for k in range(len(grads[0]))
    ]
    assert_all_close(per_feature, per_feature_tape_loop(model, x, variables))


def test_output_gradients_along_the_time_axis():
    model, x = conv_model(), random(2, 9, 4)
    variables = model.trainable_variables
    chunks = list(autodiff.output_gradients(model, x, axis=1, chunk_size=5))
    assert np.concatenate([features for features, _ in chunks]).tolist() == list(range(8))
    per_step = [[g[k] for g in grads] for _, grads in chunks for k in range(len(grads[0]))]
    assert_all_close(per_step, per_feature_tape_loop(model, x, variables, axis=1))


def test_output_gradients_of_chosen_and_non_trainable_variables():
    model, x = conv_model(), random(2, 9, 4)
    model.layers[0].trainable = False
    variables = model.layers[0].weights
    (features, grads), *_ = autodiff.output_gradients(model, x, variables, chunk_size=10)
    assert [tuple(g.shape) for g in grads] == [(7, 3, 4, 6), (7, 6)]
    assert_all_close(
        [[g[k] for g in grads] for k in features], per_feature_tape_loop(model, x, variables)
    )


# With respect to variables, like torch's `model.parameters()`.


def squared_error(model, x, y):
    return lambda weights: tf.reduce_sum((model(x) - y) ** 2)  # Reads the model's weights.


def test_grad_with_respect_to_model_variables_matches_tape_gradient():
    model, x, y = dense_model(), random(6, 5), random(6, 3, seed=1)
    loss = squared_error(model, x, y)
    with tf.GradientTape() as tape:
        expected = tape.gradient(loss(None), model.trainable_variables)
    assert_all_close(autodiff.grad(loss, model.trainable_variables), expected)
    kernel = model.layers[0].kernel  # Used through the argument, too.
    assert_all_close(autodiff.grad(lambda w: tf.reduce_sum(w**3), kernel), 3 * kernel**2)


def test_vjp_jvp_and_jacobian_with_respect_to_model_variables():
    model, x = dense_model(), random(4, 5)
    kernel, bias = model.layers[-1].trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        y = model(x)
    cotangent = random(4, 3, seed=2)
    tangents = [random(*v.shape, seed=3) for v in (kernel, bias)]
    _, vjp = autodiff.vjp(lambda w: model(x), [kernel, bias], cotangent)
    assert_all_close(vjp, tape.gradient(y, [kernel, bias], output_gradients=cotangent))
    _, jvp = autodiff.jvp(lambda w: model(x), [kernel, bias], tangents)
    jacobians = tape.jacobian(y, [kernel, bias])
    expected_jvp = sum(tf.tensordot(j, t, t.ndim) for j, t in zip(jacobians, tangents))
    assert_all_close(jvp, expected_jvp)
    assert_all_close(autodiff.jacobian(lambda w: model(x), [kernel, bias], 5), jacobians)


def test_grad_reuses_its_trace_for_the_same_variables_only():
    model, x, y = dense_model(), random(6, 5), random(6, 3, seed=1)
    counted = TraceCounter(squared_error(model, x, y))
    for _ in range(2):
        autodiff.grad(counted, model.trainable_variables)
    assert counted.traces == 1
    # Same fn, other variables of the same shapes: fn does not read them, which
    # must be an error, not the gradient of the first model's variables.
    other = keras.models.clone_model(model)
    with pytest.raises(ValueError, match=r"does not depend on inputs\[0\] \('sequential"):
        autodiff.grad(counted, other.trainable_variables)


def test_grad_with_respect_to_weight_values_says_to_pass_the_variables():
    model, x, y = dense_model(), random(6, 5), random(6, 3, seed=1)
    values = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"pass the variables themselves"):
        autodiff.grad(squared_error(model, x, y), values)


# Errors say what went wrong.


def test_disconnected_input_raises():
    with pytest.raises(ValueError, match=r"does not depend on inputs\[1\] \(shape \(3,\)\)"):
        autodiff.grad(lambda xs: xs[0] * 2.0, [np.ones(3), np.ones(3)])


def test_disconnected_variable_raises():
    model, other = dense_model(), keras.layers.Dense(2, dtype="float64")
    other.build((None, 5))
    with pytest.raises(ValueError, match=r"variables\[0\] \('dense_\d+/kernel'"):
        next(autodiff.output_gradients(model, random(2, 5), variables=other.trainable_variables))


def test_output_without_tangent_raises():
    with pytest.raises(ValueError, match=r"fn's output\[1\] does not depend on any of the primals"):
        autodiff.jvp(lambda x: [x * 2.0, tf.ones(3)], np.ones(3), np.ones(3))


def test_model_predict_is_explained():
    model = dense_model()
    with pytest.raises(TypeError, match=r"numpy array of shape \(4, 3\).*model\.predict"):
        autodiff.grad(lambda x: model.predict(x, verbose=0), random(4, 5))


def test_numpy_output_is_explained():
    with pytest.raises(TypeError, match=r"fn's output is a numpy array of shape \(3,\)"):
        autodiff.jacobian(lambda x: np.ones(3), np.ones(3))


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match=r"inputs has dtype int64"):
        autodiff.grad(lambda x: x * 2, np.arange(3))


def test_cotangents_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"`cotangents` must have the shape of fn's output"):
        autodiff.vjp(tf.sin, np.ones(3), np.ones(4))


@pytest.mark.parametrize("axis", [3, -4])
def test_output_gradients_axis_out_of_range_names_the_output_shape(axis):
    model = conv_model()
    with pytest.raises(ValueError, match=rf"shape \(None, 8, 7\).*Received: axis={axis}"):
        next(autodiff.output_gradients(model, random(2, 9, 4), axis=axis))


@pytest.mark.parametrize("axis", [0, -3])
def test_output_gradients_refuse_the_batch_axis_before_tracing(axis):
    with pytest.raises(ValueError, match=rf"axis 0 is the batch\). Received: axis={axis}"):
        autodiff.OutputGradients(conv_model(), axis=axis)


@pytest.mark.parametrize("axis", [0, -3])
def test_output_gradients_refuse_the_batch_axis_of_a_plain_callable(axis):
    model = conv_model()
    # No declared output: refused when traced (axis 0 at once, -3 once the rank is known).
    with pytest.raises(ValueError, match=rf"axis 0 is the batch.*Received: axis={axis}"):
        next(autodiff.output_gradients(lambda x: model(x), random(2, 9, 4), model.weights, axis))


def test_numpy_inside_fn_is_explained():
    with pytest.raises(TypeError, match=r"converts a tensor to numpy.*has no attribute 'numpy'"):
        autodiff.grad(lambda x: tf.constant(x.numpy()) * 2.0, np.ones(3))
    with pytest.raises(TypeError, match=r"converts a tensor to numpy.*NotImplementedError"):
        autodiff.jacobian(lambda x: tf.convert_to_tensor(np.sin(x)), np.ones(3))


def test_output_gradients_without_variables_is_refused():
    with pytest.raises(ValueError, match=r"nothing to differentiate.*Received: variables=None"):
        autodiff.output_gradients(lambda x: x * 2.0, random(2, 3))


@pytest.mark.parametrize("chunk_size", [0, 2.5, True])
def test_bad_chunk_size_is_refused(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        autodiff.output_gradients(dense_model(), random(2, 5), chunk_size=chunk_size)


# Compiled once, reused.


class TraceCounter:
    def __init__(self, fn):
        self.fn, self.traces = fn, 0

    def __call__(self, x):
        self.traces += 1  # Runs only while tracing.
        return self.fn(x)


def test_output_gradients_trace_once_for_all_chunks():
    model = conv_model(num_features=7)
    counted = TraceCounter(model)
    chunks = autodiff.output_gradients(
        counted, random(2, 9, 4), model.trainable_variables, chunk_size=3
    )
    assert len(list(chunks)) == 3
    assert counted.traces == 1


def test_output_gradients_object_traces_once_across_calls_and_matches_per_feature_tape():
    model = conv_model(num_features=7)
    counted = TraceCounter(model)
    variables = model.trainable_variables
    feature_gradients = autodiff.OutputGradients(counted, variables, chunk_size=3)
    assert feature_gradients.variables == variables
    assert (feature_gradients.axis, feature_gradients.chunk_size) == (-1, 3)
    for seed in range(3):
        x = random(2, 9, 4, seed=seed)
        chunks = list(feature_gradients(x))
        assert [features.tolist() for features, _ in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
        per_feature = [[g[k] for g in grads] for _, grads in chunks for k in range(len(grads[0]))]
        assert_all_close(per_feature, per_feature_tape_loop(model, x, variables))
        # The next call must see the weights as they are then, not as traced.
        kernel = model.layers[-1].kernel
        kernel.assign(kernel * 1.5)
    assert counted.traces == 1


def test_output_gradients_called_again_on_a_model_reuse_its_trace_and_no_other_models():
    model = conv_model(num_features=7)
    counted = TraceCounter(model)
    for seed in range(3):
        x = random(2, 9, 4, seed=seed)
        chunks = list(
            autodiff.output_gradients(counted, x, model.trainable_variables, chunk_size=4)
        )
        per_feature = [[g[k] for g in grads] for _, grads in chunks for k in range(len(grads[0]))]
        assert_all_close(per_feature, per_feature_tape_loop(model, x, model.trainable_variables))
    assert counted.traces == 1
    # A model of the same shapes and other weights: its own trace, its own gradients.
    other = keras.models.clone_model(model)
    x = random(2, 9, 4, seed=5)
    chunks = list(
        autodiff.output_gradients(TraceCounter(other), x, other.trainable_variables, chunk_size=4)
    )
    per_feature = [[g[k] for g in grads] for _, grads in chunks for k in range(len(grads[0]))]
    assert_all_close(per_feature, per_feature_tape_loop(other, x, other.trainable_variables))


@pytest.mark.parametrize("function", [autodiff.jacobian, autodiff.batch_jacobian])
def test_jacobians_trace_once_per_shape(function):
    counted = TraceCounter(dense_model())
    for seed in range(3):
        function(counted, random(4, 5, seed=seed), chunk_size=2)
    assert counted.traces == 1


def test_grad_vjp_jvp_reuse_their_trace():
    counted = TraceCounter(tf.sin)
    for seed in range(3):
        x = random(3, seed=seed)
        autodiff.grad(counted, x)
        autodiff.vjp(counted, x, x)
        autodiff.jvp(counted, x, x)
    assert counted.traces == 3


def test_a_failing_map_leaves_the_variable_scope_clean() -> None:
    """A regression: an error inside the chunked map once broke every later
    tf.distribute strategy scope in the process."""
    w = tf.Variable([1.0, 2.0])
    with pytest.raises(ValueError):
        autodiff.jacobian(lambda x: tf.stack([w[0] * 2.0, w[1]]), tf.constant([1.0, 2.0]))
    assert tf.compat.v1.get_variable_scope().caching_device is None
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        pass


# Layout.


def test_public_names_are_the_functions_and_every_module_is_under_400_lines():
    public = ["OutputGradients", "batch_jacobian", "grad", "jacobian", "jvp", "output_gradients"]
    assert sorted(autodiff.__all__) == sorted([*public, "vjp"])
    # No submodule may shadow a public function of the same name.
    assert all(callable(getattr(autodiff, name)) for name in autodiff.__all__)
    package = Path(autodiff.__file__)
    modules = sorted(package.parent.glob("*.py")) if package.name == "__init__.py" else [package]
    lengths = {module.name: len(module.read_text().splitlines()) for module in modules}
    assert max(lengths.values()) <= 400, lengths


def test_a_model_differentiated_is_not_kept_alive() -> None:
    """The traces kept across calls hold a model weakly, as on JAX and PyTorch
    (`autodiff_cases.py`): a model the user drops is collected, with its variables."""

    def differentiated() -> tuple[weakref.ref, weakref.ref]:
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        x = np.ones((3, 4), "float32")
        autodiff.vjp(model, x, np.ones((3, 2), "float32"))
        list(autodiff.OutputGradients(model, chunk_size=1)(x))
        return weakref.ref(model), weakref.ref(model.trainable_variables[0])

    model, kernel = differentiated()
    gc.collect()
    assert model() is None
    assert kernel() is None
