"""Private training with a loss scale on PyTorch: the cases of
`private_loss_scale_cases.py`, which JAX runs too."""

from private_loss_scale_cases import *  # noqa: F403 (the shared cases, collected here)
