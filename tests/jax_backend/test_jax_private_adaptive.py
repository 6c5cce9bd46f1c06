"""The cases of `private_adaptive_cases.py` on JAX."""

from private_adaptive_cases import *  # noqa: F403 (the shared cases, collected here)
