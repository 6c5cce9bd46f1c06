"""The versions pyproject.toml declares are the versions CI tests."""

from pathlib import Path

import pytest
from packaging import requirements, version

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parent.parent


def pinned_versions() -> dict[str, str]:
    lines = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {name.strip().lower(): pin.strip() for name, pin in pins}


def declared_requirements() -> dict[str, requirements.Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    parsed = [requirements.Requirement(line) for line in project["dependencies"]]
    return {requirement.name.lower(): requirement for requirement in parsed}


def test_tensorflow_and_keras_floors_are_the_tested_versions() -> None:
    pins, declared = pinned_versions(), declared_requirements()
    for name in ("tensorflow", "keras"):
        floors = [spec.version for spec in declared[name].specifier if spec.operator == ">="]
        assert [version.Version(f) for f in floors] == [version.Version(pins[name])], name


def test_the_tested_versions_satisfy_every_declared_requirement() -> None:
    pins = pinned_versions()
    for name, requirement in declared_requirements().items():
        assert requirement.specifier.contains(pins[name]), (name, pins[name])


def test_readme_names_the_tested_tensorflow_and_keras() -> None:
    pins, readme = pinned_versions(), (ROOT / "README.md").read_text()
    assert f"TensorFlow {pins['tensorflow']}, Keras {pins['keras']}" in readme
