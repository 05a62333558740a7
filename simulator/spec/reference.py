"""The scenario reference, written from the scenario's own JSON Schema.

Every field of every section, with what the typed spec says of it (its docstring is the
schema's ``description``), its unit (from the unit in its name), its default, the
values it allows (an enum, a range) and an example: the first value a bundled
scenario gives it that is not the default. The documentation site's build calls
:func:`scenario_reference` (``docs/hooks/reference.py``), so the page follows the
schema and never goes stale; :func:`stack_table` does the same for the stack presets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: A field name's ending -> the unit it names (the spec puts units in names).
UNITS = (("_GBps", "GB/s"), ("_us", "µs"), ("_MB", "MB"), ("_W", "W"), ("_h", "h"),
         ("_s", "s"), ("usd_", "USD"))
_NO_DEFAULT = object()


def unit_of(name: str) -> str:
    """The unit a field's name carries (``storage_write_GBps`` -> GB/s), else ''."""
    for part, unit in UNITS:
        if name.endswith(part) or (part.endswith("_") and name.startswith(part)):
            return unit
    return ""


def _ref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The definition a property points at (directly, in ``items`` or in an ``anyOf``)."""
    for cand in (node, node.get("items", {}), *node.get("anyOf", ())):
        ref = cand.get("$ref") if isinstance(cand, dict) else None
        if ref:
            return defs[ref.rsplit("/", 1)[-1]]
    return None


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                      ("exclusiveMaximum", "<")):
        if key in node:
            parts.append(f"{sign} {node[key]:g}".replace("e+0", "e").replace("e+", "e"))
    return ", ".join(parts)


def allowed(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """What a property accepts, in words: the enum's values, a type with its range."""
    if "anyOf" in node:
        return " or ".join(allowed(n, defs) for n in node["anyOf"])
    if "enum" in node:
        return ", ".join(f"`{v}`" for v in node["enum"])
    if "$ref" in node:
        return "mapping (below)"
    kind = node.get("type", "any")
    if kind == "array":
        items = node.get("items", {})
        inner = "mappings (below)" if "$ref" in items else allowed(items, defs)
        return f"list of {inner}"
    if kind == "object":
        return "mapping"
    if kind == "null":
        return "`null`"
    word = {"integer": "whole number", "number": "number", "boolean": "`true`, `false`",
            "string": "text"}.get(kind, kind)
    extra = _bounds(node)
    if node.get("pattern"):
        extra = f"matching `{node['pattern']}`"
    return f"{word} {extra}".strip()


def _text(value: Any, limit: int = 48) -> str:
    text = json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return f"`{text}`"


def _lookup(data: Any, path: tuple[str, ...]) -> Iterator[Any]:
    """The values at ``path`` in a scenario's dict; ``[]`` in a path walks a list."""
    if not path:
        yield data
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in data if isinstance(data, list) else ():
            yield from _lookup(item, rest)
    elif isinstance(data, dict) and head in data:
        yield from _lookup(data[head], rest)


def example(path: tuple[str, ...], default: Any, scenarios: Iterable[dict[str, Any]]) -> Any:
    """The first value the scenarios give ``path`` that is set and not the default."""
    for data in scenarios:
        for value in _lookup(data, path):
            if value not in (None, [], {}, "") and value != default:
                return value
    return None


def _row(name: str, node: dict[str, Any], path: tuple[str, ...], required: bool,
         defs: dict[str, Any], scenarios: list[dict[str, Any]]) -> str:
    default = node.get("default", _NO_DEFAULT)
    shown_default = "required" if required else (
        "" if default is _NO_DEFAULT or isinstance(default, dict) else _text(default))
    sub = _ref(node, defs)
    ex = None if sub is not None else example(path, default, scenarios)
    desc = " ".join(node.get("description", "").split())
    cells = [f"`{name}`", desc, unit_of(name), shown_default, allowed(node, defs),
             "" if ex is None else _text(ex)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _section(title: str, node: dict[str, Any], path: tuple[str, ...],
             defs: dict[str, Any], scenarios: list[dict[str, Any]]) -> Iterator[str]:
    """A section's table, then each nested section's, depth first."""
    desc = " ".join(node.get("description", "").split())
    yield f"### `{title}`\n" if title else "### Top level\n"
    if desc:
        yield f"{desc}\n"
    yield "| key | what it is | unit | default | allowed | example |"
    yield "| --- | --- | --- | --- | --- | --- |"
    required = set(node.get("required", ()))
    nested = []
    for name, prop in node.get("properties", {}).items():
        yield _row(name, prop, (*path, name), name in required, defs, scenarios)
        sub = _ref(prop, defs)
        if sub is not None:
            step = (name, "[]") if prop.get("type") == "array" else (name,)
            nested.append((name, sub, step))
    yield ""
    for name, sub, step in nested:
        key = f"{title}.{name}" if title else name
        suffix = "[]" if step[-1] == "[]" else ""
        yield from _section(f"{key}{suffix}", sub, (*path, *step), defs, scenarios)


def scenario_reference(scenario_files: Iterable[Path] = ()) -> str:
    """The reference as Markdown: the top-level keys, then one table per section. The
    examples come from ``scenario_files`` (bundled scenarios; unreadable ones are
    skipped)."""
    from simulator.errors import UserError
    from simulator.spec.load import load_scenario
    from simulator.spec.scenario import Scenario

    scenarios = []
    for path in scenario_files:
        try:
            scenarios.append(load_scenario(path).to_dict())
        except UserError:
            continue
    schema = Scenario.model_json_schema()
    defs = schema.get("$defs", {})
    lines = list(_section("", {**schema, "description": ""}, (), defs, scenarios))
    return "\n".join(lines) + "\n"


def stack_table() -> str:
    """Every stack preset's fields side by side (a row per field, a column per preset)."""
    from simulator.spec.stack import StackSpec, load_stack, preset_stack_names

    names = preset_stack_names()
    stacks = [load_stack(n).model_dump(mode="json") for n in names]
    lines = ["| field | " + " | ".join(f"`{n}`" for n in names) + " |",
             "| --- |" + " --- |" * len(names)]
    for field in StackSpec.model_fields:
        if field in ("preset", "name", "description"):
            continue
        cells = [", ".join(v) if isinstance(v, list) else json.dumps(v).strip('"')
                 for v in (st[field] for st in stacks)]
        lines.append(f"| `{field}` | " + " | ".join(c or "–" for c in cells) + " |")
    return "\n".join(lines) + "\n"
