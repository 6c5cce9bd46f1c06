"""`kgt.check` on PyTorch: the cases of `check_cases.py`, which TensorFlow and JAX run too."""

from check_cases import *  # noqa: F403 (the shared cases, collected here)
