"""Loss scaling on PyTorch (a `LossScaleOptimizer`, `mixed_float16`, an optimizer's
`loss_scale_factor`): the cases of `loss_scaling_cases.py`, which JAX runs too."""

from loss_scaling_cases import *  # noqa: F403 (the shared cases, collected here)
