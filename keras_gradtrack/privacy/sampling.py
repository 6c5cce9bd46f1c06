"""Poisson sampling of batches: each example joins each step's batch independently.

The accountant's guarantee (`compute_epsilon`) is for this sampling: every step
draws each of the `N` examples with probability `q`, so batch sizes vary around
`q N`; train with `make_private(..., expected_batch_size=q * N)` so that the
update's divisor does not depend on the data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
from keras import tree


def poisson_batch_indices(
    dataset_size: int,
    sampling_rate: float,
    steps: int | None = None,
    seed: int | Sequence[int] | None = None,
) -> Iterator[np.ndarray]:
    """The indices of each step's Poisson-sampled batch, in increasing order.

    Args:
        dataset_size: `N`, the number of examples.
        sampling_rate: `q`, each example's probability to be in a batch.
        steps: Batches to draw (default `round(1 / q)`: one epoch in expectation).
        seed: Seed of numpy's generator (an int or a sequence of ints; None: fresh
            entropy).

    Yields:
        `int64` index arrays. An empty draw (probability `(1 - q)^N`) is skipped: a
        step needs an example; with `q N >= 10` that happens less than once in 20000 steps.

    Example:

    ```python
    for indices in poisson_batch_indices(60000, 256 / 60000, steps=10, seed=0):
        model.train_on_batch(x[indices], y[indices])
    ```
    """
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
        raise ValueError(
            f"Expected dataset_size to be a positive integer. Received: dataset_size={dataset_size!r}"
        )
    if not isinstance(sampling_rate, (int, float)) or not 0 < sampling_rate <= 1:
        raise ValueError(
            f"Expected sampling_rate in (0, 1]. Received: sampling_rate={sampling_rate!r}"
        )
    if steps is None:
        steps = max(1, round(1 / sampling_rate))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Expected steps to be a positive integer. Received: steps={steps!r}")
    rng = np.random.default_rng(seed)
    drawn = 0
    while drawn < steps:
        indices = np.flatnonzero(rng.random(dataset_size) < sampling_rate).astype(np.int64)
        if indices.size:
            drawn += 1
            yield indices


def poisson_batches(
    x: Any,
    y: Any = None,
    sampling_rate: float = 0.01,
    steps: int | None = None,
    seed: int | None = None,
    accumulation_steps: int = 1,
) -> Any:
    """Poisson-sampled batches of `(x, y)` (or `x`), for `fit`: a `tf.data.Dataset` on
    TensorFlow, a `keras.utils.PyDataset` on JAX and PyTorch (no TensorFlow needed).

    With `accumulation_steps=k`, each Poisson draw is a logical batch, yielded as `k`
    physical batches of near-equal size (`make_private(..., accumulation_steps=k)`
    adds them into one update); a draw of fewer than `k` examples is skipped, as an
    empty one is.

    Args:
        x: The inputs: a numpy array (or a dict or tuple of arrays) of `N` examples.
        y: The targets, or None.
        sampling_rate: `q`, each example's probability to be in a batch.
        steps: Batches per pass over the dataset object (default `round(1 / q)`);
            each pass (each epoch of `fit`) draws anew.
        seed: Seed of the draws (None: fresh entropy).
        accumulation_steps: `k`, the physical batches of each drawn (logical) batch.

    Returns:
        A dataset of variable-size batches, `steps * accumulation_steps` per epoch.

    Example:

    ```python
    q = 256 / len(x)
    model.make_private(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=q * len(x))
    model.fit(kgt.privacy.poisson_batches(x, y, sampling_rate=q, seed=0), epochs=60)
    ```
    """
    arrays = tree.map_structure(np.asarray, x if y is None else (x, y))
    leaves = tree.flatten(arrays)
    size = len(leaves[0])
    if any(len(leaf) != size for leaf in leaves):
        raise ValueError(
            "Expected every array to hold the same number of examples. Received lengths: "
            f"{[len(leaf) for leaf in leaves]}"
        )
    if steps is None:
        steps = max(1, round(1 / sampling_rate))
    k = accumulation_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"Expected accumulation_steps to be a positive integer. Received: {k!r}")
    stream = PoissonStream(arrays, size, sampling_rate, steps, seed, k)
    if keras.backend.backend() != "tensorflow":
        return PoissonBatches(stream)
    import tensorflow as tf

    signature = tree.map_structure(
        lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), arrays
    )

    def batches() -> Iterator[Any]:
        for rows in stream.epoch_rows():
            yield stream.batch(rows)

    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    # `fit` then knows an epoch's steps (it would warn that the input ran out otherwise).
    return dataset.apply(tf.data.experimental.assert_cardinality(steps * k))


class PoissonStream:
    """The physical batches' rows of each pass (epoch): `steps` Poisson draws of the
    `size` examples with rate `q` (a draw of fewer than `k` examples skipped), each
    split into `k` near-equal parts; pass `e` drawn from the seed `[seed, e]`."""

    def __init__(self, arrays: Any, size: int, q: float, steps: int, seed: Any, k: int) -> None:
        self.arrays, self.size, self.q, self.steps, self.seed, self.k = (
            arrays, size, q, steps, seed, k,
        )  # fmt: skip
        self.passes = 0

    def epoch_rows(self) -> list[np.ndarray]:
        """The next pass's rows, one index array per physical batch, in order."""
        pass_seed = None if self.seed is None else [self.seed, self.passes]
        self.passes += 1
        drawn = poisson_batch_indices(self.size, self.q, 2**62, pass_seed)
        logical = (indices for indices in drawn if indices.size >= self.k)
        return [
            rows
            for _, indices in zip(range(self.steps), logical)
            for rows in np.array_split(indices, self.k)
        ]

    def batch(self, rows: np.ndarray) -> Any:
        return tree.map_structure(lambda a: a[rows], self.arrays)


class PoissonBatches(keras.utils.PyDataset):
    """`poisson_batches` on JAX and PyTorch: a `keras.utils.PyDataset` whose epoch is one
    pass of the stream, drawn when the epoch's first batch is read (anew after
    `on_epoch_end`)."""

    def __init__(self, stream: PoissonStream) -> None:
        super().__init__()
        self.stream = stream
        self.rows: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.stream.steps * self.stream.k

    def __getitem__(self, index: int) -> Any:
        if self.rows is None:
            self.rows = self.stream.epoch_rows()
        return self.stream.batch(self.rows[index])

    def on_epoch_end(self) -> None:
        self.rows = None
