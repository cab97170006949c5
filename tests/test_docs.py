"""The README stays a front door and the documentation site stays whole, without MkDocs.

The strict build (`mkdocs build --strict` in .ci/run) checks links and anchors; these checks are
the cheap ones it cannot make: the README's length and its two commands, every page under docs/
reachable from the navigation, and a configuration reference that covers every config field.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 200
# The README's two commands, word for word: the fresh machine's setup and main job, and the tests.
TWO_COMMANDS = (
    "scripts/install.sh && .venv/bin/dapo run --config configs/smollm2-135m.yaml",
    "scripts/test.sh",
)


class _AnyTagLoader(yaml.SafeLoader):
    """Reads mkdocs.yml: its `!!python/name:` and `!relative` values are not needed here."""


_AnyTagLoader.add_multi_constructor("", lambda loader, tag, node: None)


def _mkdocs() -> dict[str, Any]:
    loaded = yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_AnyTagLoader)
    assert isinstance(loaded, dict)
    return loaded


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    return []


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_door() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    # On the first screen: within the first 30 lines.
    first_screen = "\n".join(readme.splitlines()[:30])
    for command in TWO_COMMANDS:
        assert command in first_screen, command


def test_every_docs_page_is_in_the_navigation_and_every_entry_exists() -> None:
    config = _mkdocs()
    nav = _nav_pages(config["nav"])
    excluded = {line.strip().rstrip("/") for line in config["exclude_docs"].splitlines()}
    pages = {
        path.relative_to(DOCS).as_posix()
        for path in DOCS.rglob("*.md")
        if path.relative_to(DOCS).parts[0] not in excluded
    }
    generated = {_hook("config_reference").PAGE}
    assert len(nav) == len(set(nav)), "a page is in the navigation twice"
    assert pages - set(nav) == set(), "pages missing from mkdocs.yml's nav"
    assert set(nav) - pages - generated == set(), "nav entries with no page"


def test_configuration_reference_covers_every_field() -> None:
    hook = _hook("config_reference")
    page = hook.render()
    keys = hook.field_keys()
    assert "rollout.group_size" in keys and "learner.lora.rank" in keys
    for key in keys:
        assert f"{{#{key}}}" in page, f"{key} is missing from the configuration reference"
    # The documentation written beside a field is on the page, with its default.
    assert "Responses per prompt, G (paper: 16)." in page
    assert "#### `rollout.group_size` {#rollout.group_size}\n\n`int` (≥ 1) · default `16`" in page
