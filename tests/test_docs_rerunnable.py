"""Every documented snippet that writes a log at a fixed path runs twice in a row in the
same folder: its logger says `overwrite=` (or `append=`), never failing on its own file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITERS = re.compile(r"\b(HDF5GradientLogger|OutputGradientLogger)\(")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def calls(code: str) -> list[str]:
    """The text of every logger call in `code`, up to its closing parenthesis."""
    found = []
    for match in WRITERS.finditer(code):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if depth == 0:
                break
        found.append(code[match.start() : end + 1])
    return found


def test_every_documented_logger_of_a_fixed_path_says_overwrite_or_append() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    one_shot = [
        f"{page.name}: {call}"
        for page in pages
        for block in python_blocks(page.read_text())
        for call in calls(block)
        if re.search(r"\(\s*[\"']", call) and not re.search(r"\b(overwrite|append)=", call)
    ]
    assert one_shot == []


def test_the_check_finds_a_one_shot_logger() -> None:
    block = 'model.fit(x, y, callbacks=[kgt.HDF5GradientLogger("run.h5", every_n_steps=(2))])'
    assert calls(block) == ['HDF5GradientLogger("run.h5", every_n_steps=(2))']
