"""The two primitives `autodiff/functional.py` asks of PyTorch: one forward pass and
`torch.autograd.grad` with the graph kept (`is_grads_batched` for a stack of
cotangents), and `torch.func.jvp`."""

from collections.abc import Callable
from typing import Any

import torch


def linearize(function: Callable[[list[Any]], list[Any]], values: list[Any]):
    """`(outputs, pull_back)`: `pull_back(cotangents, batched)` gives the values'
    gradients (stacked along a first axis when the cotangents are), `None` for a
    value the outputs do not depend on."""
    leaves = [value.detach().requires_grad_(True) for value in values]
    with torch.enable_grad():
        outputs = function(leaves)

    def pulled_back(cotangents: list[Any], batched: bool) -> list[Any]:
        connected = [(y, c) for y, c in zip(outputs, cotangents) if y.requires_grad]
        if not connected:
            return [None] * len(leaves)
        found = torch.autograd.grad(
            [y for y, _ in connected],
            leaves,
            grad_outputs=[c for _, c in connected],
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=batched,
        )
        return [None if g is None else g.detach() for g in found]

    return [y.detach() for y in outputs], pulled_back


def jit(function: Callable[..., Any]) -> Callable[..., Any]:
    """Never called: autodiff runs eagerly on PyTorch."""
    raise NotImplementedError("autodiff compiles on JAX only")


def forward_product(
    function: Callable[[list[Any]], list[Any]], values: list[Any], tangents: list[Any]
):
    """`(outputs, jvps)` in forward mode."""
    found = torch.func.jvp(
        lambda *leaves: tuple(function(list(leaves))),
        tuple(v.detach() for v in values),
        tuple(tangents),
    )
    return list(found[0]), list(found[1])
