"""The least the statistics can cost: extra multiply-adds over the plain step, per zoo model.

Counted per example from each layer call's shapes (one forward pass on one example
records them), over the products with weights (matrix products and convolutions) and
attention's two products; elementwise work (activations, normalizations, biases,
embedding lookups) is left out of both sides, so a model whose plain step is mostly
elementwise has a lower true bound than printed. Per call of a layer applied at `P`
positions with `n_in` inputs and `n_out` outputs per position:

* plain step: `6 P n_in n_out` (forward, input gradient, weight gradient);
* per-example squared norms: the direct form `2 P^2 (n_in + n_out)` (Gram matrices;
  `2 (n_in + n_out)` when `P = 1`), or materialized per-example gradients, which take
  the weight gradient's place and add `3 n_in n_out` (sum and squares);
* dots with the batch gradient (cosines): `2 P n_in n_out` in the direct form,
  `2 n_in n_out` more on materialized gradients, or (for `P = 1`) both norms and dots
  from the batch's Gram matrix, `2 B (n_in + n_out)` per example.

Each layer takes the cheaper form for the statistics asked; the bound is
`(plain + extra) / plain`, for the default statistics (norms and dots) and for norms
alone. The measured ratios are in docs/performance.md beside it.

```
python benchmarks/flop_bound.py            # every zoo model, a few seconds
```
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
from zoo import ZOO, synthetic_batches

from keras_gradtrack._keras_seam import flatten_layers
from keras_gradtrack._patching import patched_each

L = keras.layers


@dataclasses.dataclass(frozen=True)
class Product:
    """One product with a weight: `positions` x (`inputs` -> `outputs`) per example."""

    layer: str
    positions: int
    inputs: int
    outputs: int

    @property
    def plain(self) -> float:
        return 6.0 * self.positions * self.inputs * self.outputs

    @property
    def weights(self) -> int:
        return self.inputs * self.outputs

    def norms(self) -> float:
        p, n_in, n_out = self.positions, self.inputs, self.outputs
        direct = 2.0 * (n_in + n_out) * (p * p if p > 1 else 1)
        return min(direct, 3.0 * self.weights)

    def norms_and_dots(self, batch: int) -> float:
        p, n_in, n_out = self.positions, self.inputs, self.outputs
        direct = 2.0 * (n_in + n_out) * (p * p if p > 1 else 1) + 2.0 * p * self.weights
        options = [direct, 5.0 * self.weights]
        if p == 1:
            # The batch's Gram matrix (a_i . a_j)(d_i . d_j): its diagonal the norms, its
            # row sums the dots (the batch gradient is the examples' sum).
            options.append(2.0 * batch * (n_in + n_out))
        return min(options)


def size(shape: Any) -> int:
    return int(np.prod([d for d in shape[1:]], dtype=np.int64))


def products(layer: Any, inputs: Any, outputs: Any) -> list[Product]:
    """The weight products of one call, from its input and output shapes."""
    name = type(layer).__name__
    if isinstance(layer, L.SeparableConv2D):
        depth = layer.depthwise_kernel
        point = layer.pointwise_kernel
        positions = size(outputs.shape) // point.shape[-1]
        return [
            # The depthwise products (one per channel) counted as one of their size.
            Product(name, positions, int(np.prod(depth.shape)), 1),
            Product(name, positions, point.shape[2], point.shape[3]),
        ]
    if isinstance(layer, L.DepthwiseConv2D):
        kernel = layer.kernel
        channels = kernel.shape[2] * kernel.shape[3]
        return [Product(name, size(outputs.shape) // channels, int(np.prod(kernel.shape)), 1)]
    if isinstance(layer, L.Conv2DTranspose | L.Conv1DTranspose):
        kernel = layer.kernel  # (..., out, in)
        return [
            Product(
                name,
                size(inputs.shape) // kernel.shape[-1],
                kernel.shape[-1],
                int(np.prod(kernel.shape[:-1])),
            )
        ]
    if isinstance(layer, L.Conv1D | L.Conv2D | L.Conv3D):
        kernel = layer.kernel  # (..., in, out)
        return [
            Product(
                name,
                size(outputs.shape) // kernel.shape[-1],
                int(np.prod(kernel.shape[:-1])),
                kernel.shape[-1],
            )
        ]
    if isinstance(layer, L.Dense | L.EinsumDense):
        kernel_size = int(np.prod(layer.kernel.shape))
        n_in, n_out = size(inputs.shape), size(outputs.shape)
        positions = round(math.sqrt(n_in * n_out / kernel_size))
        return [Product(name, positions, n_in // positions, n_out // positions)]
    return []


def attention_products(layer: Any, query: Any) -> list[Product]:
    """MultiHeadAttention's scores and weighted sum (no weights: plain cost only)."""
    tokens = query.shape[1]
    heads, key_dim = layer.num_heads, layer.key_dim
    value_dim = layer.value_dim or key_dim
    scores = Product("attention", tokens, heads * key_dim, tokens)
    mixed = Product("attention", tokens, tokens, heads * value_dim)
    return [scores, mixed]


def model_products(name: str) -> tuple[list[Product], list[Product]]:
    """(products with weights, products without) of one example's step."""
    model = ZOO[name].build(keras.Model)
    x, _ = synthetic_batches(name, 1, 1)
    weighted: list[Product] = []
    free: list[Product] = []
    layers = [
        layer
        for layer in flatten_layers(model, include_self=False)
        if not isinstance(layer, keras.Model)
    ]

    def recording(layer: Any) -> Any:
        call = layer.call

        def recorded(*args: Any, **kwargs: Any) -> Any:
            outputs = call(*args, **kwargs)
            inputs = args[0] if args else next(iter(kwargs.values()))
            if isinstance(layer, L.MultiHeadAttention):
                free.extend(attention_products(layer, inputs))
            elif layer.trainable_weights:
                weighted.extend(products(layer, inputs, outputs))
            return outputs

        return recorded

    with patched_each([(layer, "call", recording(layer)) for layer in layers]):
        model(x[:1])
    return weighted, free


def bound_row(name: str, batch: int) -> dict[str, Any]:
    weighted, free = model_products(name)
    plain = sum(p.plain for p in weighted + free)
    return {
        "model": name,
        "plain MFLOP/example": plain / 1e6,
        "default statistics": 1.0 + sum(p.norms_and_dots(batch) for p in weighted) / plain,
        "norms only": 1.0 + sum(p.norms() for p in weighted) / plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    rows = [bound_row(name, args.batch_size) for name in ZOO if name != "separable_jit"]
    print(f"B={args.batch_size}")
    print("| model | plain MFLOP / example | bound, default statistics | bound, norms only |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['model']} | {row['plain MFLOP/example']:.2f} | "
            f"{row['default statistics']:.3f}x | {row['norms only']:.3f}x |"
        )


if __name__ == "__main__":
    main()
