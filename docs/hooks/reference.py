"""MkDocs hook: the generated parts of the site, written when it is built.

A page holds a marker (an HTML comment, invisible on GitHub) where a generated part
goes; this hook replaces it with what the project itself says: the scenario reference
from the scenario's JSON Schema (:func:`simulator.spec.reference.scenario_reference`,
examples from the bundled scenarios), the stack presets side by side
(:func:`simulator.spec.reference.stack_table`) and the CLI reference from the parser
(:func:`simulator.cli.reference.cli_reference`). A field, a stack or a command added
later is on the next build's pages without anyone editing them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The scenario whose values come first among the reference's examples.
FIRST_EXAMPLE = "gpt3-175b-1024.yaml"


def _scenario_reference(root: Path) -> str:
    from simulator.spec.reference import scenario_reference

    files = sorted((root / "scenarios").glob("*.yaml"), key=lambda p: p.name != FIRST_EXAMPLE)
    return scenario_reference(files)


def _stack_table(root: Path) -> str:
    from simulator.spec.reference import stack_table

    return stack_table()


def _cli_reference(root: Path) -> str:
    from simulator.cli.reference import cli_reference

    return cli_reference()


GENERATED: dict[str, Callable[[Path], str]] = {
    "<!-- generated: scenario-reference -->": _scenario_reference,
    "<!-- generated: stack-table -->": _stack_table,
    "<!-- generated: cli-reference -->": _cli_reference,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    root = Path(config["config_file_path"]).parent
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make(root))
    return markdown
