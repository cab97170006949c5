"""Reading a run's configuration: a YAML file (which may extend another), dotted command-line
overrides laid over it, validation into a `DapoConfig` with errors that name key, value and
reason, and the YAML dump that reads back to an equal config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from contracts.config.base import ConfigError
from contracts.config.tree import DapoConfig


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(f"override {key}: {prefix} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` -> ("a.b", VALUE parsed as YAML, so 0.3 is a float and null is None)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={raw!r}: not a valid value ({exc})") from exc
    return key, value


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}={shown}: unknown key")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {key}={shown}: {msg}")
    return "\n".join(lines)


def build_config(
    tree: dict[str, Any], overrides: list[str] | None = None, *, source: str = "config"
) -> DapoConfig:
    """Validate a raw tree plus dotted overrides; raise ConfigError naming key, value, reason."""
    merged: dict[str, Any] = yaml.safe_load(yaml.safe_dump(tree)) or {}  # deep copy
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(merged, key, value)
    try:
        return DapoConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> DapoConfig:
    """Read a YAML file and apply overrides. Missing or malformed files are ConfigErrors.

    A file may start from another: `extends: other.yaml` (relative to the file) reads that one
    first and lays this file's keys over it, section by section (the LoRA presets are their full
    fine-tuning presets plus a few lines)."""
    path = Path(path)
    return build_config(_read_tree(path, ()), overrides, source=str(path))


EXTENDS = "extends"
MAX_EXTENDS = 8


def _read_tree(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path}: top level must be a mapping, got {type(tree).__name__}"
        )
    parent = tree.pop(EXTENDS, None)
    if parent is None:
        return tree
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"config file {path}: `{EXTENDS}` must name a YAML file")
    chain = (*chain, path.resolve())
    parent_path = path.parent / parent
    if parent_path.resolve() in chain or len(chain) > MAX_EXTENDS:
        names = " -> ".join(str(p) for p in (*chain, parent_path))
        raise ConfigError(f"config file {path}: `{EXTENDS}` goes round or too deep: {names}")
    return _overlay(_read_tree(parent_path, chain), tree)


def _overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _overlay(out[key], value)
        else:
            out[key] = value
    return out


def dump_config(cfg: DapoConfig) -> str:
    """YAML text that `load_config` reads back to an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
