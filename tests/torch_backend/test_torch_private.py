"""Private training on PyTorch: the update is the clipped sum of the per-example
gradients (against `torch.autograd.grad` per example), plus noise of deviation
`sigma C`, over `B_expected` (the cases of `private_step_cases.py`, which JAX runs too)."""

from typing import Any
from unittest import mock

from private_step_cases import *  # noqa: F403 (the shared cases, collected here)
from private_step_cases import batch, private_model, update
from torch_oracle import CountedProducts

from keras_gradtrack.backends.ops import payload


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


def test_a_private_step_with_nothing_to_log_reads_no_batch_gradient() -> None:
    """Without a batch gradient the columns take none of its place: no zeros stand in
    for `G`, and no `||G^(k)||^2` is computed (only the norms the clipping reads);
    `test_without_noise_the_update_is_the_clipped_sum` holds the update to the oracle."""
    model = private_model("cnn")
    model.make_private(l2_norm_clip=1.0, noise_multiplier=0.0)
    seen: list[Any] = []
    layer_columns = payload.layer_columns

    def spy(model: Any, plan: Any, probed: Any, *args: Any) -> Any:
        columns = layer_columns(model, plan, probed, *args)
        seen.append((probed.grads, columns))
        return columns

    with mock.patch.object(payload, "layer_columns", spy):
        update(model, *batch("cnn"))
    ((grads, columns),) = seen
    assert grads is None
    assert [reference for _, reference in columns] == [None] * len(model.tracked_layer_names)
    assert all(primitives.sq_norm.shape == (len(batch("cnn")[0]),) for primitives, _ in columns)
