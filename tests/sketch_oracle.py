"""The sketches' oracle, for both backends' tests (numpy only): a flat per-example gradient
projected as the definition says (`engine.attribution_requests.projection_matrices`)."""

from __future__ import annotations

from typing import Any

import numpy as np


def oracle_sketches(
    gradients: np.ndarray, shapes: list[tuple[int, ...]], matrices: list[tuple[Any, Any]]
) -> np.ndarray:
    """`(n, K)` sketches `R^T M C` of flat gradients `(n, P)` over variables of `shapes`
    (in order), each gradient `M` as a (rows, last axis) matrix; `(R, C)` per variable."""
    sketches, start = [], 0
    for shape, (rows, columns) in zip(shapes, matrices):
        size = int(np.prod(shape))
        width = shape[-1] if shape else 1
        part = gradients[:, start : start + size].reshape(len(gradients), -1, width)
        projected = np.einsum("nrc,rq,cs->nqs", part, np.asarray(rows, np.float64), columns)
        sketches.append(projected.reshape(len(gradients), -1))
        start += size
    assert start == gradients.shape[1], "the shapes do not cover the gradients"
    return np.concatenate(sketches, axis=1)
