"""MkDocs hook: the configuration reference, generated from the pydantic config tree.

The package `contracts.config` (one module per section of the tree) documents every field once,
beside it: a docstring under the field (or a `Field(description=...)`), read from whichever module
defines the field's model. When the site is built this hook renders that tree as the page
`configuration.md`, so the reference cannot drift from the code: every field of `DapoConfig`
under its dotted key (the key a YAML file nests and a command-line override names), its type and
bounds, its default and its documentation; each nested model is a section of its own.

`render()` needs only pydantic and the project (tests/test_docs.py calls it without MkDocs).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[2]
PAGE = "configuration.md"
PACKAGE = "contracts.config"
SOURCE = "contracts/config/"

_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
)
_PLAIN_SCALAR = re.compile(r"^[A-Za-z0-9_./:-]+$")
_YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "~"}


def root_model() -> type[BaseModel]:
    """The config tree's root, imported from this checkout (not another install of it)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from contracts.config import DapoConfig

    return DapoConfig


def sections(
    model: type[BaseModel], key: str = "", doc: str = ""
) -> Iterator[tuple[str, type[BaseModel], str]]:
    """(dotted key, model, the parent field's documentation) of `model` and every model nested in
    it, in declaration order, parents first."""
    yield key, model, doc
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            child = f"{key}.{name}" if key else name
            yield from sections(nested, child, field_doc(model, name))


def field_keys(model: type[BaseModel] | None = None) -> list[str]:
    """Every leaf field's dotted key (`rollout.tools.max_turns`)."""
    keys = []
    for key, section, _ in sections(model or root_model()):
        for name, field in section.model_fields.items():
            if _nested_model(field.annotation) is None:
                keys.append(f"{key}.{name}" if key else name)
    return keys


def field_doc(model: type[BaseModel], name: str) -> str:
    """A field's documentation: its `Field(description=...)`, else the docstring under it."""
    description = model.model_fields[name].description
    return inspect.cleandoc(description) if description else _attribute_docs(model).get(name, "")


@cache
def _attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """The string literal written right under each field, as written (escapes kept as text)."""
    source = textwrap.dedent(inspect.getsource(model))
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            literal = ast.get_source_segment(source, after.value) or ""
            docs[node.target.id] = inspect.cleandoc(_strip_quotes(literal))
    return docs


def _strip_quotes(literal: str) -> str:
    literal = literal.lstrip("rRuU")
    quote = literal[:3] if literal[:3] in ('"""', "'''") else literal[:1]
    return literal[len(quote) : -len(quote)]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (also when it may be null), or None for a plain value."""
    for candidate in (annotation, *_union_members(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return get_args(annotation)
    return ()


def _bounds(metadata: list[Any]) -> list[str]:
    bounds = []
    for item in metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(item, kind):
                bounds.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, FieldInfo):  # a bound written inside an Annotated element type
            bounds.extend(_bounds(item.metadata))
        if getattr(item, "pattern", None):
            bounds.append(f"matching `{item.pattern}`")
    return bounds


def type_text(annotation: Any) -> str:
    """A field's type as a reader of the YAML file sees it."""
    if annotation is type(None):
        return "null"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{_yaml(value)}`" for value in args)
    if _union_members(annotation):
        return " or ".join(type_text(member) for member in args)
    if origin is typing.Annotated:
        bounds = _bounds(list(args[1:]))
        return type_text(args[0]) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0])}"
        return f"list of {len(args)}: " + ", ".join(type_text(arg) for arg in args)
    if isinstance(annotation, type):
        return f"`{annotation.__name__}`"
    return f"`{annotation}`"


def _yaml(value: Any) -> str:
    """A default as it would be written in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    if isinstance(value, str):
        plain = _PLAIN_SCALAR.match(value) and value.lower() not in _YAML_WORDS
        return value if plain else '"' + value.replace('"', '\\"') + '"'
    return repr(value)


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "default: every field at its default"
    return f"default `{_yaml(value)}`"


def _field_block(key: str, field: FieldInfo, doc: str) -> str:
    bounds = _bounds(field.metadata)
    type_line = type_text(field.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
    lines = [f"#### `{key}` {{#{key}}}", "", f"{type_line} · {_default_text(field)}"]
    if doc:
        lines += ["", doc]
    return "\n".join(lines)


def _section_block(key: str, model: type[BaseModel], parent_doc: str) -> str:
    if not key:
        return "## Top level {#top-level}\n\nThe run's name and where it writes."
    field = _field_at(key)
    lines = [f"## `{key}` {{#{key}}}", ""]
    kind = f"`{model.__name__}`"
    if field is not None and field.is_required():
        lines.append(f"{kind} · required")
    elif field is not None and field.get_default() is None:
        lines.append(f"{kind} or null · default `null` (set it to use these fields)")
    else:
        lines.append(f"{kind} · every field has a default")
    for text in (parent_doc, inspect.cleandoc(model.__doc__ or "")):
        if text:
            lines += ["", text]
    return "\n".join(lines)


def _field_at(key: str) -> FieldInfo | None:
    """The field a dotted key names in the tree."""
    *path, name = key.split(".")
    model: type[BaseModel] | None = root_model()
    for part in path:
        model = _nested_model(model.model_fields[part].annotation) if model else None
    return model.model_fields.get(name) if model else None


def render() -> str:
    """The whole reference page, in Markdown."""
    root_model()  # puts this checkout first on the path
    # The package docstring's first paragraph after its title: the file, overrides, strictness.
    intro = inspect.cleandoc(importlib.import_module(PACKAGE).__doc__ or "").split("\n\n")[1]
    parts = [
        "# Configuration",
        f"Generated from `{SOURCE}` when this site is built (`docs/hooks/config_reference.py`): "
        "every field of the config tree, under the dotted key a YAML file nests and a "
        "command-line override names (`dapo run --config FILE algorithm.clip_high=0.3`), with "
        "its type, its bounds, its default and the documentation written beside it in the code.",
        intro,
        "The presets in `configs/` are complete examples; [the algorithm](algorithm.md) gives "
        "each DAPO setting's formula and the paper's value.",
    ]
    for key, model, doc in sections(root_model()):
        parts.append(_section_block(key, model, doc))
        for name, field in model.model_fields.items():
            if _nested_model(field.annotation) is None:
                dotted = f"{key}.{name}" if key else name
                parts.append(_field_block(dotted, field, field_doc(model, name)))
    return "\n\n".join(parts) + "\n"


# --- MkDocs events ------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Adds the generated page to the site's files (MkDocs 1.6 `File.generated`)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """`mkdocs serve` rebuilds when the config tree changes."""
    server.watch(str(REPO / SOURCE))
    return server
