"""The cases of `private_history_cases.py` on JAX."""

from private_history_cases import *  # noqa: F403 (the shared cases, collected here)
