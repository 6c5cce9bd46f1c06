"""Private training on PyTorch: the update is the clipped sum of the per-example
gradients (against `torch.autograd.grad` per example), plus noise of deviation
`sigma C`, over `B_expected` (the cases of `private_step_cases.py`, which JAX runs too)."""

from private_step_cases import *  # noqa: F403 (the shared cases, collected here)
from private_step_cases import batch, private_model, update
from torch_oracle import CountedProducts


def test_a_private_step_with_nothing_to_log_computes_no_weight_gradient() -> None:
    """Its update is the clipped sums' and the noise: the backward pass leaves out the
    batch gradient, so the MLP's step runs the products of a plain forward and backward
    pass and no more (each Dense layer's clipped sum `A^T (w * D)` takes the place of
    its weight gradient; its norms `||a_i||^2 ||d_i||^2` take none)."""
    model = private_model("mlp")
    model.make_private(l2_norm_clip=1.0, noise_multiplier=0.0)
    x, y = batch("mlp")
    update(model, x, y)  # builds the step
    with CountedProducts() as private:
        update(model, x, y)
    plain = private_model("mlp")
    update(plain, x, y)
    with CountedProducts() as counted:
        update(plain, x, y)
    assert private.count == counted.count, (private.count, counted.count)
