"""Argument checks of the autodiff functions, and errors that say what went wrong."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_gradtrack.autodiff.arguments import (
    mismatched_shape,
    mismatched_structure,
    named_leaves,
    shapes_of,
)

_CALL_THE_MODEL = (
    "Gradients flow only through TensorFlow operations on the tensors fn receives, "
    "and `model.predict(x)` returns numpy without recording anything on a tape. "
    "Call the model instead: `fn = lambda x: model(x)`."
)
CUT_GRADIENT_HINT = (
    "Make sure fn computes its output from it with differentiable TensorFlow "
    "operations: integer casts, argmax, `tf.stop_gradient` and numpy round trips "
    "(`.numpy()`, `model.predict`) cut the gradient."
)


@contextlib.contextmanager
def explaining_numpy_round_trips(fn, inputs):
    """Turns the tracing error of a fn that goes through numpy into a clear TypeError.

    Symbolic tensors have no `.numpy()` and numpy functions cannot take them,
    so such a fn fails while being traced with an AttributeError or a
    NotImplementedError. Calling fn eagerly tells that case (fn runs, and
    returns numpy or tensors) apart from other errors.
    """
    try:
        yield
    except (AttributeError, NotImplementedError) as error:
        if not tf.executing_eagerly():
            raise
        try:
            outputs = fn(inputs)
        except Exception:
            raise error from None
        check_tensor_outputs(outputs, cause=error)
        if "numpy" in str(error):
            raise TypeError(
                "fn must compute its output with TensorFlow operations, but it converts a "
                "tensor to numpy (`.numpy()`, `np.asarray`, a numpy function) while being "
                "traced. Numpy values carry no gradient: use `tf` or `keras.ops` functions "
                f"instead. Received: {type(error).__name__}: {error}"
            ) from error
        raise


def check_tensor_outputs(outputs, cause=None):
    for name, leaf in named_leaves(outputs, "fn's output"):
        if not tf.is_tensor(leaf):
            if isinstance(leaf, np.ndarray | np.generic):
                received = f"a numpy array of shape {np.shape(leaf)}"
            else:
                received = f"a {type(leaf).__name__}"
            message = f"fn must return tensors, but {name} is {received}. {_CALL_THE_MODEL}"
            raise TypeError(message) from cause


def check_single_output(y):
    check_tensor_outputs(y)
    if not tf.is_tensor(y):
        raise TypeError(
            "fn must return one tensor (e.g. `lambda x: model(x)[0]` for a model with "
            f"several outputs). Received outputs with shapes {shapes_of(y)}"
        )


def check_connected(sources, gradients, sources_name):
    named_sources = named_leaves(sources, sources_name)
    for (name, source), gradient in zip(named_sources, tf.nest.flatten(gradients)):
        if gradient is None:
            variable_path = _variable_path(source)
            path = f"'{variable_path}', " if variable_path else ""
            message = (
                f"fn's output does not depend on {name} ({path}shape {tuple(source.shape)}), "
                f"so its gradient is undefined (TensorFlow returns None). {CUT_GRADIENT_HINT}"
            )
            if not path:
                message += (
                    " To differentiate with respect to a model's weights, pass the variables "
                    "themselves (e.g. `model.trainable_variables`), not their values."
                )
            raise ValueError(message)


def _variable_path(source):
    if isinstance(source, keras.Variable):
        return source.path
    if isinstance(source, tf.Variable):
        return source.name.removesuffix(":0")
    return None


def as_tensors(structure, name):
    tensors = [tf.convert_to_tensor(leaf) for _, leaf in named_leaves(structure, name)]
    return keras.tree.pack_sequence_as(structure, tensors)


def as_sources(structure, name):
    """What to differentiate with respect to: floating-point tensors, or variables.

    A variable stays a variable, so that its gradient is found however fn reads
    it: through its argument or through the model holding it, as in
    `torch.autograd.grad(loss, model.parameters())`. A Keras variable becomes the
    tf.Variable it wraps, whose reads are what a tape records.
    """
    sources = []
    for leaf_name, leaf in named_leaves(structure, name):
        if isinstance(leaf, keras.Variable):
            leaf = leaf.value
        source = leaf if isinstance(leaf, tf.Variable) else tf.convert_to_tensor(leaf)
        if not (source.dtype.is_floating or source.dtype.is_complex):
            raise TypeError(
                f"Gradients are defined for floating-point inputs only, but {leaf_name} has "
                f"dtype {source.dtype.name}. Cast it first, e.g. `tf.cast(x, 'float32')`."
            )
        sources.append(source)
    return keras.tree.pack_sequence_as(structure, sources)


def matched_to(values, reference, name, reference_name):
    """Flattens `values`, checked against `reference`'s structure and shapes, in its dtypes."""
    try:
        tf.nest.assert_same_structure(values, reference, check_types=False)
    except (ValueError, TypeError):
        raise mismatched_structure(name, values, reference, reference_name) from None
    matched = []
    for (value_name, value), ref in zip(named_leaves(values, name), tf.nest.flatten(reference)):
        if not value.shape.is_compatible_with(ref.shape):
            raise mismatched_shape(value_name, value.shape, ref.shape, reference_name)
        matched.append(tf.cast(value, ref.dtype))
    return matched
