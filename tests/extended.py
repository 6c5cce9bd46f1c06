"""Parameters of which some are `extended`: slow cases that repeat what faster ones
cover, left out of `make test` and run by `make test-all` (and CI).

Example:

```python
@pytest.mark.parametrize("name", with_extended(sorted(CASES), {"bidirectional_lstm"}))
```
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import pytest


def with_extended(values: Iterable[Any], extended: Collection[Any]) -> list[Any]:
    """`values` as parameters, those in `extended` marked `extended`."""
    return [pytest.param(v, marks=pytest.mark.extended) if v in extended else v for v in values]
