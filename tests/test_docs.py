"""The documentation builds with `mkdocs build --strict` (API reference from docstrings).

Pages other people write (`PAGES_WRITTEN_ELSEWHERE`) are in the nav; while one does not
exist yet, the build uses a copy of docs/ with a placeholder for it, so that everything
else (nav, links, anchors, docstrings) is still checked strictly.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
PAGES_WRITTEN_ELSEWHERE = ("performance.md", "reliability.md", "autodiff.md")


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_nav_page_exists_or_is_expected():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    on_disk = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert sorted(set(on_disk) - set(pages)) == []
    assert sorted(set(pages) - set(on_disk) - set(PAGES_WRITTEN_ELSEWHERE)) == []


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    for page in PAGES_WRITTEN_ELSEWHERE:
        if not (docs / page).exists():
            (docs / page).write_text(f"# {page} (not written yet)\n")
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
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (site / "api" / "index.html").read_text()
    for name in ("GradientLog.most_influential", "analysis.self_influence", "plots.plot_steps"):
        assert f'id="keras_gradtrack.{name}"' in api
