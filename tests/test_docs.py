"""The documentation builds with `mkdocs build --strict` (API reference from docstrings),
every page is in the nav, and every test the pages cite exists.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import patience
import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_nav_page_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    on_disk = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert sorted(set(on_disk) - set(pages)) == []
    assert sorted(set(pages) - set(on_disk)) == []


def test_every_test_the_pages_cite_exists():
    """`test_file.py::test_name` in a page (the reliability table cites one per row)."""
    cited = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        cited |= set(re.findall(r"(test_\w+)\.py::(test_\w+)", page.read_text()))
    assert cited
    # A backend's tests live in a folder of their own (tests/torch_backend/...).
    files = {path.stem: path for path in (ROOT / "tests").rglob("test_*.py")}
    missing = [
        f"{module}.py::{name}"
        for module, name in sorted(cited)
        if module not in files or not re.search(rf"^def {name}\(", files[module].read_text(), re.M)
    ]
    assert missing == []


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    handler = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(ROOT)]
    config_file, site = tmp_path / "mkdocs.yml", tmp_path / "site"
    config_file.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "-f",
            config_file,
            "-d",
            site,
        ],
        capture_output=True,
        text=True,
        timeout=patience.seconds(5),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (site / "api" / "index.html").read_text()
    for name in ("GradientLog.most_influential", "analysis.step_quantiles", "plots.plot_steps"):
        assert f'id="keras_gradtrack.{name}"' in api
