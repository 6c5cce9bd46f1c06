"""The one-run audit (Steinke, Nasr, Jagielski 2023) of the PyTorch engine's private step:
`tests/test_privacy_audit.py`'s audits of the real step, run in this process on PyTorch.
Dirac canaries through `make_private`'s step stay below the accountant's epsilon, and
the noise or the clipping taken out (`clipping_off`, the seam both engines share) is
refuted."""

from test_privacy_audit import (
    test_the_private_step_stays_below_the_accountant,
    test_the_secure_noise_stays_below_the_accountant,
    test_without_clipping_the_audit_refutes_the_accountant,
    test_without_noise_the_audit_refutes_the_accountant,
)

__all__ = [
    "test_the_private_step_stays_below_the_accountant",
    "test_the_secure_noise_stays_below_the_accountant",
    "test_without_clipping_the_audit_refutes_the_accountant",
    "test_without_noise_the_audit_refutes_the_accountant",
]
