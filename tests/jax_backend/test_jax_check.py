"""`kgt.check` on JAX: the cases of `check_cases.py`, which TensorFlow and PyTorch run too."""

from check_cases import *  # noqa: F403 (the shared cases, collected here)
