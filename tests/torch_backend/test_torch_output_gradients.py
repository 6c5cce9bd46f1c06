"""OutputGradientLogger on PyTorch: the cases of `output_gradient_cases.py`, which JAX runs too."""

from output_gradient_cases import *  # noqa: F403 (the shared cases, collected here)
