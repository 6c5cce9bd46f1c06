"""`make demo` installs only what the demo runs, not the development set of `make install`."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = (Path(__file__).resolve().parent.parent / "Makefile").read_text()


def rule(target: str) -> tuple[str, str]:
    """(prerequisites, recipe) of `target` in the Makefile."""
    found = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", MAKEFILE, re.M)
    assert found, target
    return found.group(1).split(), found.group(2)


def test_the_demo_installs_its_extras_only() -> None:
    prerequisites, _ = rule("demo")
    assert prerequisites == ["$(DEMO_STAMP)"]
    _, recipe = rule("$(DEMO_STAMP)")
    installs = re.findall(r"pip install [^\n]*-e \"\.\[([^\]]*)\]\"", recipe)
    assert installs == ["demo,plots,tensorboard"]
