"""The PyTorch kernels give the shared rules' numbers (`backends/torch/kernels.py`).

Each kernel against the `keras.ops` form it replaces and against torch's own per-example
gradients: Dense's direct form on every branch it takes (the Gram form of `<g_i, R>` and
the product with `R`, with a reference factor or without, with a bias or without, float32
and float16 inputs) and on the shapes it hands back to the shared rule; the
convolutions' per-example gradients with strides, padding, dilation, channels first,
1-D and 3-D, and grouped (the shared form); Dense's local VJP (the private step's clipped
sum) against autograd's; the registry runs the kernels on PyTorch.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import torch

from keras_gradtrack import rule_math
from keras_gradtrack.backends.ops import conv as ops_conv
from keras_gradtrack.backends.ops import rules as ops_rules
from keras_gradtrack.backends.ops.probes import preactivation_call
from keras_gradtrack.backends.ops.rules import ProbedCall
from keras_gradtrack.backends.torch import kernels
from keras_gradtrack.backends.torch.registry import lookup


def dense_case(batch, width_in, width_out, steps=None, use_bias=True, dtype="float32"):
    layer = keras.layers.Dense(width_out, use_bias=use_bias, dtype=dtype)
    shape = (batch, width_in) if steps is None else (batch, steps, width_in)
    layer.build(shape)
    generator = torch.Generator().manual_seed(batch * 1000 + width_in)
    inputs = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    out_shape = (*shape[:-1], width_out)
    output_grad = torch.randn(out_shape, generator=generator).to(getattr(torch, dtype))
    refs = [torch.randn(tuple(v.shape), generator=generator) for v in layer.trainable_variables]
    return layer, inputs, output_grad, refs


def assert_same_primitives(kernel, shared, factor):
    np.testing.assert_allclose(kernel.sq_norm.numpy(), shared.sq_norm.numpy(), rtol=1e-5)
    np.testing.assert_allclose(kernel.dot.numpy(), shared.dot.numpy(), rtol=1e-4, atol=1e-5)
    if factor is None:
        np.testing.assert_allclose(float(kernel.sum_sq_norm), float(shared.sum_sq_norm), rtol=1e-5)
    else:
        assert kernel.sum_sq_norm is None and shared.sum_sq_norm is None


@pytest.mark.parametrize("factor", [None, 0.125])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize(
    "batch, width_in, width_out",
    [(8, 784, 256), (128, 784, 256), (64, 6, 5), (3, 1, 1)],
    ids=["gram", "gram-large", "product", "tiny"],
)
def test_dense_kernel_gives_the_shared_rules_primitives(
    batch, width_in, width_out, use_bias, factor
):
    layer, inputs, output_grad, refs = dense_case(batch, width_in, width_out, use_bias=use_bias)
    call = ProbedCall(inputs, {}, output_grad, factor)
    kernel = kernels.dense_primitives(layer, call, refs)
    shared = ops_rules.dense_primitives(layer, call, refs)
    assert_same_primitives(kernel, shared, factor)


def test_the_cases_take_both_forms_of_the_dot():
    """The parametrization reaches both of the kernel's branches."""
    assert rule_math.gram_has_fewer_products(8, 784, 256)
    assert not rule_math.gram_has_fewer_products(64, 6, 5)


def test_dense_kernel_on_float16_inputs_computes_in_float32():
    layer, inputs, output_grad, refs = dense_case(16, 12, 7, dtype="float16")
    call = ProbedCall(inputs, {}, output_grad, None)
    kernel = kernels.dense_primitives(layer, call, refs)
    assert kernel.sq_norm.dtype == torch.float32
    assert_same_primitives(kernel, ops_rules.dense_primitives(layer, call, refs), None)


def test_dense_kernel_matches_per_example_gradients():
    """Against the per-example gradients themselves, not only the shared form."""
    layer, inputs, output_grad, refs = dense_case(5, 4, 3)
    call = ProbedCall(inputs, {}, output_grad, None)
    kernel = kernels.dense_primitives(layer, call, refs)
    kernel_grads = torch.einsum("bi,bo->bio", inputs, output_grad)
    flat = torch.cat([kernel_grads.reshape(5, -1), output_grad], dim=1)
    reference = torch.cat([refs[0].reshape(-1), refs[1]])
    np.testing.assert_allclose(kernel.sq_norm.numpy(), (flat**2).sum(1).numpy(), rtol=1e-5)
    np.testing.assert_allclose(kernel.dot.numpy(), (flat @ reference).numpy(), rtol=1e-4)
    np.testing.assert_allclose(
        float(kernel.sum_sq_norm), float((flat.sum(0) ** 2).sum()), rtol=1e-5
    )


@pytest.mark.parametrize("factor", [None, 0.5])
def test_sequences_are_the_shared_rules(factor):
    layer, inputs, output_grad, refs = dense_case(4, 6, 5, steps=3)
    call = ProbedCall(inputs, {}, output_grad, factor)
    assert_same_primitives(
        kernels.dense_primitives(layer, call, refs),
        ops_rules.dense_primitives(layer, call, refs, materialize=True),
        factor,
    )
    # JAX's step materializes them itself (and sums them for the batch gradient).
    assert ops_rules.dense_primitives(layer, call, refs) is None


@pytest.mark.parametrize("factor", [None, 0.25])
@pytest.mark.parametrize("steps", [None, 3, 40], ids=["2d", "gram", "materialized"])
def test_norm_only_dense_forms_leave_the_dot_out(steps, factor, monkeypatch):
    """`refs=None`: the same norms (and `||S||^2` without a factor), `dot` None, from the
    kernel and from each of the shared rule's forms."""
    monkeypatch.setattr(ops_rules, "MATERIALIZED_VALUES", 100)
    layer, inputs, output_grad, refs = dense_case(4, 6, 5, steps=steps)
    call = ProbedCall(inputs, {}, output_grad, factor)
    if steps is not None:
        assert ops_rules.dense_takes_gram_form(4, steps, 6, 5) == (steps == 3)
    shared = functools.partial(ops_rules.dense_primitives, materialize=True)
    for primitives in (kernels.dense_primitives, shared):
        full, norms = primitives(layer, call, refs), primitives(layer, call, None)
        assert norms.dot is None
        np.testing.assert_allclose(norms.sq_norm.numpy(), full.sq_norm.numpy(), rtol=1e-6)
        if factor is None:
            np.testing.assert_allclose(float(norms.sum_sq_norm), float(full.sum_sq_norm))
        else:
            assert norms.sum_sq_norm is None


def test_norm_only_embedding_leaves_the_dot_out():
    layer = keras.layers.Embedding(7, 4)
    layer.build((3, 5))
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (3, 5), generator=generator)
    ids[:, 1] = ids[:, 0]  # a repeated id
    output_grad = torch.randn((3, 5, 4), generator=generator)
    call = ProbedCall(ids, {}, output_grad, None)
    full = ops_rules.embedding_primitives(layer, call, [torch.randn((7, 4), generator=generator)])
    norms = ops_rules.embedding_primitives(layer, call, None)
    assert norms.dot is None
    np.testing.assert_allclose(norms.sq_norm.numpy(), full.sq_norm.numpy(), rtol=1e-6)
    np.testing.assert_allclose(float(norms.sum_sq_norm), float(full.sum_sq_norm))


def test_lora_dense_is_not_the_kernels():
    layer, inputs, output_grad, _ = dense_case(4, 6, 5)
    layer.enable_lora(2)
    refs = [torch.zeros(tuple(v.shape)) for v in layer.trainable_variables]
    assert kernels.dense_primitives(layer, ProbedCall(inputs, {}, output_grad), refs) is None
    assert lookup(layer).name == "lora_dense"


def test_the_registry_runs_the_kernel_for_dense():
    rule = lookup(keras.layers.Dense(3))
    assert rule is kernels.DENSE
    assert rule.primitives is kernels.dense_primitives
    assert rule.per_example is ops_rules.DENSE.per_example


CONVOLUTIONS = {
    "conv2d": (lambda: keras.layers.Conv2D(5, 3), (4, 9, 9, 3)),
    "conv2d-first-layer": (lambda: keras.layers.Conv2D(8, 3), (4, 12, 12, 1)),
    "strided-same": (
        lambda: keras.layers.Conv2D(4, (3, 2), strides=2, padding="same"),
        (3, 8, 7, 2),
    ),
    "dilated": (lambda: keras.layers.Conv2D(3, 3, dilation_rate=2, use_bias=False), (2, 9, 9, 2)),
    "channels-first": (
        lambda: keras.layers.Conv2D(4, 2, data_format="channels_first"),
        (3, 2, 6, 6),
    ),
    "conv1d-causal": (lambda: keras.layers.Conv1D(6, 4, padding="causal"), (5, 11, 3)),
    "conv3d": (lambda: keras.layers.Conv3D(2, 2), (2, 4, 5, 4, 3)),
    "grouped": (lambda: keras.layers.Conv2D(4, 3, groups=2), (3, 7, 7, 4)),
}


@pytest.mark.parametrize("name", sorted(CONVOLUTIONS))
def test_conv_kernel_gives_the_shared_rules_per_example_gradients(name):
    build, shape = CONVOLUTIONS[name]
    layer = build()
    layer.build(shape)
    generator = torch.Generator().manual_seed(len(name))
    inputs = torch.randn(shape, generator=generator)
    output_grad = torch.randn(tuple(layer.compute_output_shape(shape)), generator=generator)
    values = [v.value for v in layer.trainable_variables]
    call = ProbedCall(inputs, {}, output_grad)
    kernel = kernels.conv_per_example(layer, values, call)
    shared = ops_conv.conv_per_example(layer, values, call)
    assert [tuple(g.shape) for g in kernel] == [tuple(g.shape) for g in shared]
    for k, s in zip(kernel, shared):
        np.testing.assert_allclose(k.numpy(), s.numpy(), rtol=1e-5, atol=1e-5)


def test_conv_kernel_matches_autograd_per_example():
    """Example i's kernel gradient is torch's own for example i alone."""
    layer = keras.layers.Conv2D(3, 3, strides=2, padding="same", use_bias=False)
    shape = (3, 7, 6, 2)
    layer.build(shape)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(shape, generator=generator)
    output_grad = torch.randn(tuple(layer.compute_output_shape(shape)), generator=generator)
    kernel = layer.trainable_variables[0].value
    call = ProbedCall(inputs, {}, output_grad)
    (per_example,) = kernels.conv_per_example(layer, [kernel], call)
    for i in range(shape[0]):
        outputs = layer(inputs[i : i + 1])
        (expected,) = torch.autograd.grad(torch.sum(outputs * output_grad[i : i + 1]), [kernel])
        np.testing.assert_allclose(per_example[i].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_the_registry_runs_the_conv_kernel():
    rule = lookup(keras.layers.Conv2D(3, 3))
    assert rule is kernels.CONV and rule.per_example is kernels.conv_per_example
    assert rule.primitives is ops_conv.CONV.primitives


def autograd_local_vjp(layer, values, inputs, cotangent):
    """The local VJP by autograd through the layer's pre-activation call (what
    `private_step.local_vjp` does for a layer without a kernel)."""
    with torch.enable_grad():
        leaves = [value.detach().requires_grad_(True) for value in values]
        outputs = preactivation_call(layer, leaves, [], inputs, {})
        return list(torch.autograd.grad(outputs, leaves, grad_outputs=cotangent))


@pytest.mark.parametrize("steps", [None, 5], ids=["2-d", "sequence"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_local_vjp_is_autograds(steps, use_bias):
    layer, inputs, cotangent, _ = dense_case(6, 7, 4, steps=steps, use_bias=use_bias)
    layer.activation = keras.activations.get("relu")  # the VJP is the pre-activation's
    values = [v.value.detach() for v in layer.trainable_variables]
    fast = kernels.dense_local_vjp(layer, values, inputs, cotangent)
    expected = autograd_local_vjp(layer, values, inputs, cotangent)
    assert len(fast) == len(expected) == (2 if use_bias else 1)
    for f, e in zip(fast, expected):
        np.testing.assert_allclose(f.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)


class ScaledDense(keras.layers.Dense):
    def call(self, inputs):
        return 2.0 * super().call(inputs)


def test_dense_local_vjp_leaves_other_layers_to_autograd():
    _, inputs, cotangent, _ = dense_case(3, 4, 2)
    scaled = ScaledDense(2)
    scaled.build((3, 4))
    values = [v.value.detach() for v in scaled.trainable_variables]
    assert kernels.dense_local_vjp(scaled, values, inputs, cotangent) is None
    lora = keras.layers.Dense(2)
    lora.build((3, 4))
    lora.enable_lora(1)
    values = [v.value.detach() for v in lora.trainable_variables]
    assert kernels.dense_local_vjp(lora, values, inputs, cotangent) is None
    half, inputs16, cotangent16, _ = dense_case(3, 4, 2, dtype="float16")
    values = [v.value.detach() for v in half.trainable_variables]
    assert kernels.dense_local_vjp(half, values, inputs16, cotangent16) is None
    conv = keras.layers.Conv1D(2, 1)
    conv.build((3, 5, 4))
    assert kernels.dense_local_vjp(conv, [], inputs, cotangent) is None
