"""keras_gradtrack.autodiff on PyTorch: the cases of `autodiff_cases.py`, which JAX runs too."""

from autodiff_cases import *  # noqa: F403 (the shared cases, collected here)
