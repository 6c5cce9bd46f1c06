"""The cases of `private_accumulation_cases.py` on PyTorch."""

from private_accumulation_cases import *  # noqa: F403 (the shared cases, collected here)
