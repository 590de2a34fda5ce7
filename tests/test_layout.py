"""The shape the project keeps: pages a reader can take in, one name per class, and a target
package whose top level a newcomer can scan."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PAGE_LINES = 400
MAX_README_LINES = 250
MAX_TARGET_TOP_LEVEL_MODULES = 16
FOLDERS = ("tandem", "tandem_kernels", "target_service", "draft_service", "training", "bench", "tests")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_page_in_docs_is_over_400_lines_and_the_readme_under_250():
    long = {str(page.relative_to(ROOT)): _lines(page) for page in (ROOT / "docs").rglob("*.md")
            if _lines(page) > MAX_PAGE_LINES}
    assert not long, f"split these by topic: {long}"
    assert _lines(ROOT / "README.md") < MAX_README_LINES


def test_the_target_service_has_at_most_16_modules_at_its_top_level():
    modules = sorted(path.name for path in (ROOT / "target_service").glob("*.py"))
    assert len(modules) <= MAX_TARGET_TOP_LEVEL_MODULES, modules


def test_no_two_classes_share_a_name():
    """One name per thing: a class name says which class it is, wherever it is read (the generated
    stubs in tandem/v1 excepted: the proto names those)."""
    seen: dict[str, list[str]] = {}
    for path in (path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[:2] == ("tandem", "v1") or "__pycache__" in parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


def test_an_installed_package_carries_the_native_decoders_sources():
    """A non-editable install (the Docker image's `pip install .`) compiles the native decoder on
    first use: every source it compiles must be package data."""
    import fnmatch
    import tomllib

    from tandem.model import native

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tandem"]
    for name in native.SOURCES:
        path = f"model/csrc/{name}"
        assert any(fnmatch.fnmatch(path, pattern) for pattern in patterns), path
