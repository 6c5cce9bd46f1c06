"""Batch plumbing: example ids in the input dict, batch sizes, float inputs."""

from __future__ import annotations

import difflib
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gradtrack._keras_seam import functional_inputs

EXAMPLE_ID_KEY = "example_id"


# Example ids are logged as int64, exactly: these dtypes convert to it losslessly.
EXAMPLE_ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def check_example_ids(x: Any, model: Any = None) -> None:
    """Raises unless `x['example_id']`, when present, holds one integer id per example,
    and (given the `model`) every other key of a dict `x` can be one of its inputs.

    Accepts numpy arrays, tensors and `AnySpec`s; call it on `fit`'s `x`
    before Keras converts the arrays (it fails on string ids with "Invalid dtype").

    Raises:
        ValueError: saying what ids must be, and how to get there from strings or
            unsigned 64-bit hashes; or naming a key that is neither the ids nor an
            input (`check_input_keys`).
    """
    if model is not None:
        check_input_keys(model, x)
    if not isinstance(x, dict) or EXAMPLE_ID_KEY not in x:
        return
    ids = x[EXAMPLE_ID_KEY]
    if not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    dtype = dtype_name(ids.dtype)
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


def check_input_keys(model: Any, x: Any) -> None:
    """Raises for a key of a dict `x` (or a dataset's dict `x`) that is neither
    `"example_id"` nor one of the model's inputs: a misspelt id key would otherwise be
    taken for an input, and the ids silently logged as positions.

    A dict whose keys are the model's input names is the model's input; with the ids
    and exactly one other entry, that entry is the input whatever its key. The input
    names are known for functional and Sequential models; for a subclassed model only
    a key that reads like `"example_id"` is refused.

    Raises:
        ValueError: naming the key, the closest accepted name and the accepted names.

    Example:

    ```python
    check_input_keys(model, {"pixels": x, "example_ids": ids})
    # ValueError: ... Did you mean 'example_id'? ...
    ```
    """
    spec = getattr(x, "element_spec", None)
    if spec is not None:  # a tf.data.Dataset: (x, y, ...) or x
        x = spec[0] if isinstance(spec, tuple) else spec
    if not isinstance(x, dict):
        return
    keys = [key for key in x if key != EXAMPLE_ID_KEY]
    if EXAMPLE_ID_KEY in x and len(keys) == 1:
        return
    names = input_names(model)
    accepted = [EXAMPLE_ID_KEY, *names]
    for key in keys:
        if key in names:
            continue
        # "example_ids", "exampleId", "example-id": not "examples" or "sample_id".
        reads_like_ids = bool(
            difflib.get_close_matches(str(key).lower(), [EXAMPLE_ID_KEY], cutoff=0.85)
        )
        if reads_like_ids or (names and len(keys) > len(names)):
            close = difflib.get_close_matches(str(key), [str(name) for name in accepted], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            known = f"nor an input of model {model.name!r} ({names})" if names else "nor an input"
            raise ValueError(
                f"The input dict holds the key {key!r}, which is neither {EXAMPLE_ID_KEY!r} "
                f"(the example ids, logged with every row) {known}.{hint} Received keys: "
                f"{list(x)}"
            )


def input_names(model: Any) -> list[str]:
    """The names a dict input of `model` may use: the keys of a functional model's dict
    inputs, or its input layers' names ([] for a subclassed model)."""
    structure = functional_inputs(model)
    if structure is None:
        return []
    if isinstance(structure, dict):
        return list(structure)
    return [tensor.name for tensor in tree.flatten(structure)]


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


def dtype_name(dtype: Any) -> str:
    """The dtype's name as Keras spells it ("int64"); "string" for numpy's and
    TensorFlow's strings (numpy's `<U4`, which Keras does not name)."""
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        if np.dtype(dtype).kind in "USO":
            return "string"
        raise


def float_inputs(x: Any) -> list[Any]:
    """The batch's float input tensors (for input gradients).

    Raises:
        ValueError: If no input is a float tensor.
    """
    inputs = [keras.ops.convert_to_tensor(t) for t in tree.flatten(x) if t is not None]
    floats = [t for t in inputs if "float" in keras.backend.standardize_dtype(t.dtype)]
    if not floats:
        raise ValueError(
            "input_grad_norm needs float inputs: the gradient with respect to integer "
            f"inputs (such as token ids) is not defined. Received input dtypes: "
            f"{[keras.backend.standardize_dtype(t.dtype) for t in inputs]}"
        )
    return floats
