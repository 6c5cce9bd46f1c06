"""Batch plumbing: example ids in the input dict, batch sizes, float inputs."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

EXAMPLE_ID_KEY = "example_id"


# Example ids are logged as int64, exactly: these dtypes convert to it losslessly.
EXAMPLE_ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def check_example_ids(x: Any) -> None:
    """Raises unless `x['example_id']`, when present, holds one integer id per example.

    Accepts numpy arrays, tensors and `tf.TensorSpec`s; call it on `fit`'s `x`
    before Keras converts the arrays (it fails on string ids with "Invalid dtype").

    Raises:
        ValueError: saying what ids must be, and how to get there from strings or
            unsigned 64-bit hashes.
    """
    if not isinstance(x, dict) or EXAMPLE_ID_KEY not in x:
        return
    ids = x[EXAMPLE_ID_KEY]
    if not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    dtype = tf.as_dtype(ids.dtype).name
    shape = tuple(ids.shape)
    if dtype in EXAMPLE_ID_DTYPES and len(shape) == 1:
        return
    advice = ""
    if dtype == "uint64":
        advice = (
            " uint64 ids from 2**63 up do not fit int64: pass `ids.view(np.int64)` (the same "
            "64 bits, read back with `.view(np.uint64)`)."
        )
    elif dtype == "string":
        advice = " Map string ids to integers first, e.g. `np.unique(ids, return_inverse=True)[1]`."
    raise ValueError(
        f"Expected `x['{EXAMPLE_ID_KEY}']` to hold one integer per example: shape (batch,), "
        f"a dtype among {list(EXAMPLE_ID_DTYPES)} (logged as int64, exactly). "
        f"Received: dtype={dtype}, shape={shape}.{advice}"
    )


def split_example_ids(x: Any, validate: bool = True) -> tuple[Any, Any]:
    """Removes the `example_id` entry from a dict input.

    Args:
        x: The batch's inputs.
        validate: Check that the ids are one integer per example (`check_example_ids`).

    Returns:
        `(x, ids)`: the model's input (the remaining entry's value when exactly
        one remains) and the ids, or `(x, None)` when `x` holds no ids.
    """
    if not isinstance(x, dict) or EXAMPLE_ID_KEY not in x:
        return x, None
    if validate:
        check_example_ids(x)
    rest = {key: value for key, value in x.items() if key != EXAMPLE_ID_KEY}
    ids = x[EXAMPLE_ID_KEY]
    if len(rest) == 1:
        return next(iter(rest.values())), ids
    return rest, ids


def unpack_batch(data: Any, validate: bool = True) -> tuple[Any, Any, Any, Any]:
    """`(x, y, sample_weight, example_ids)` of one batch as `fit` yields it."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, ids = split_example_ids(x, validate)
    return x, y, sample_weight, ids


def strip_example_ids(data: Any, validate: bool = True) -> Any:
    """The batch without its example ids, in the form Keras' own steps expect."""
    x, y, sample_weight, ids = unpack_batch(data, validate)
    if ids is None:
        return data
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


def batch_size_of(x: Any) -> tf.Tensor:
    """The number of examples in the batch (int32 scalar)."""
    first = next(t for t in tree.flatten(x) if t is not None)
    return tf.shape(first)[0]


def float_inputs(x: Any) -> list[tf.Tensor]:
    """The batch's float input tensors (for input gradients).

    Raises:
        ValueError: If no input is a float tensor.
    """
    inputs = [tf.convert_to_tensor(t) for t in tree.flatten(x) if t is not None]
    floats = [t for t in inputs if t.dtype.is_floating]
    if not floats:
        raise ValueError(
            "input_grad_norm needs float inputs: the gradient with respect to integer "
            f"inputs (such as token ids) is not defined. Received input dtypes: "
            f"{[t.dtype.name for t in inputs]}"
        )
    return floats
