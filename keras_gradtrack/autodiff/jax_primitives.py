"""The two primitives `autodiff/functional.py` asks of JAX: `jax.vjp` (its pull-back
vectorized over a stack of cotangents by `jax.vmap`) and `jax.jvp`."""

import contextlib
from collections.abc import Callable
from typing import Any

import jax


def linearize(function: Callable[[list[Any]], list[Any]], values: list[Any]):
    """`(outputs, pull_back)`: `pull_back(cotangents, batched)` gives the values'
    gradients (stacked along a first axis when the cotangents are)."""
    with _explaining_numpy_round_trips():
        outputs, pull_back = jax.vjp(function, list(values))

    def pulled_back(cotangents: list[Any], batched: bool) -> list[Any]:
        if batched:
            return list(jax.vmap(lambda c: pull_back(c)[0])(list(cotangents)))
        return list(pull_back(list(cotangents))[0])

    return outputs, pulled_back


def jit(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled with XLA (`jax.jit`); differentiating it differentiates the
    compiled call."""
    return jax.jit(function)


def forward_product(
    function: Callable[[list[Any]], list[Any]], values: list[Any], tangents: list[Any]
):
    """`(outputs, jvps)` in forward mode."""
    with _explaining_numpy_round_trips():
        return jax.jvp(function, (list(values),), (list(tangents),))


@contextlib.contextmanager
def _explaining_numpy_round_trips():
    try:
        yield
    except jax.errors.TracerArrayConversionError as error:
        raise TypeError(
            "fn must compute its output with the backend's operations, but it converts a "
            "tensor to numpy (`np.asarray`, `keras.ops.convert_to_numpy`, a numpy "
            "function, `model.predict`). Numpy values carry no gradient: use `keras.ops` "
            "or `jax.numpy` functions instead."
        ) from error
