"""Argument checks every backend's autodiff shares (no TensorFlow, no JAX, no torch)."""

from collections.abc import Callable
from typing import Any

import keras
import numpy as np


def check_chunk_size(chunk_size, allow_none):
    if chunk_size is None and allow_none:
        return
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int | np.integer)
        or chunk_size < 1
    ):
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"`chunk_size` must be {expected}. Received: chunk_size={chunk_size!r}")


def check_feature_axis(axis, output_shape):
    """Refuses an `axis` that is not an integer or that selects the batch axis."""
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"`axis` must be an integer. Received: axis={axis!r}")
    if output_shape is None:
        if axis == 0:
            raise ValueError(
                "`axis` must select a feature axis of the model output, and axis 0 is the "
                "batch (each example's own gradient is what GradientTrackingModel computes). "
                "Received: axis=0"
            )
        return
    rank = len(output_shape)
    if not -rank < axis < rank or axis == 0:
        feature_axes = f"1..{rank - 1} or -{rank - 1}..-1" if rank > 1 else "none"
        raise ValueError(
            f"`axis` must select a feature axis of the model output, which has shape "
            f"{output_shape} (feature axes: {feature_axes}; axis 0 is the batch). "
            f"Received: axis={axis}"
        )


def declared_output_shape(model):
    """The shape of a built functional or Sequential model's one output, else None."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if isinstance(outputs, list | tuple) and len(outputs) == 1:
        return tuple(outputs[0].shape)
    return None


class FeatureGradientSettings:
    """What `OutputGradients` is given on every backend, checked: the model, the
    variables (its trainable ones by default), the feature axis and the chunk size; a
    backend's `OutputGradients` says in `_compile` how its pull-backs run."""

    def __init__(
        self,
        model: Callable,
        variables: Any = None,
        axis: int = -1,
        chunk_size: int = 16,
        *,
        jit_compile: bool | None = None,
    ) -> None:
        check_chunk_size(chunk_size, allow_none=False)
        variables = _default_variables(model, variables)
        # Refused now when the model declares its output; otherwise at the first call.
        check_feature_axis(axis, declared_output_shape(model))
        self._model = model
        self._variables = variables
        self._axis = int(axis)
        self._chunk_size = int(chunk_size)
        self._compile(jit_compile)

    def _compile(self, jit_compile: bool | None) -> None:
        """Prepares the backend's pull-backs (`jit_compile` as `output_gradients` takes it)."""
        raise NotImplementedError

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
        """Features per chunk."""
        return self._chunk_size


def mismatched_structure(name: str, values: Any, reference: Any, reference_name: str):
    return ValueError(
        f"`{name}` must have the structure of {reference_name}, {shapes_of(reference)}. "
        f"Received: {name}={shapes_of(values)}"
    )


def mismatched_shape(value_name: str, shape: Any, reference_shape: Any, reference_name: str):
    return ValueError(
        f"`{value_name}` must have the shape of {reference_name}, {tuple(reference_shape)}. "
        f"Received: shape {tuple(shape)}"
    )


def _default_variables(model, variables):
    """`variables`, else the model's trainable variables; refuses nothing to differentiate."""
    if variables is None:
        variables = getattr(model, "trainable_variables", None)
    if not variables:
        raise ValueError(
            "There is nothing to differentiate: pass `variables=`, or build the model "
            "(call it once) so that `model.trainable_variables` is not empty. "
            f"Received: variables={variables!r}"
        )
    return list(variables)


def named_leaves(structure, name) -> list[tuple[str, Any]]:
    return [
        (name + "".join(f"[{key!r}]" for key in path), leaf)
        for path, leaf in keras.tree.flatten_with_path(structure)
    ]


def shapes_of(structure):
    return keras.tree.map_structure(
        lambda leaf: tuple(leaf.shape) if hasattr(leaf, "shape") else type(leaf).__name__,
        structure,
    )
