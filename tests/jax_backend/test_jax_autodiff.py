"""keras_gradtrack.autodiff on JAX: the cases of `autodiff_cases.py`, which PyTorch runs too."""

from autodiff_cases import *  # noqa: F403 (the shared cases, collected here)
