"""The cases of `private_refusal_cases.py` on PyTorch."""

from private_refusal_cases import *  # noqa: F403 (the shared cases, collected here)
