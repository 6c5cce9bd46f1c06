"""The utility driver's JAX route: the case of `private_utility_cases.py`."""

from private_utility_cases import *  # noqa: F403 (the shared case, collected here)
