"""pyproject's license is an SPDX expression (a TOML table is deprecated by setuptools,
which prints a warning box at every install), with the setuptools that reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_license_is_an_spdx_expression_read_by_the_required_setuptools() -> None:
    config = tomllib.loads(PYPROJECT.read_text())
    assert config["project"]["license"] == "Apache-2.0"
    build = {
        requirement.name: requirement.specifier
        for requirement in map(requirements.Requirement, config["build-system"]["requires"])
    }
    # Setuptools reads `project.license` as a string from 77 on.
    assert "76.9" not in build["setuptools"] and "77.0" in build["setuptools"]
