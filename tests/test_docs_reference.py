"""The generated pages of the documentation site: the scenario reference covers every
field the schema has, with its unit, default, allowed values and an example from a
bundled scenario; the CLI reference covers every command and every option the parser
has, a command registered later included; the stack table has every preset; and the
site's hook fills every marker the pages hold."""

from __future__ import annotations

import argparse
import importlib.util
import re
import types
from pathlib import Path
from typing import Any

import pytest

from simulator.cli import main as cli_main
from simulator.cli.common import add_command
from simulator.cli.reference import cli_reference, command_parsers, help_lines
from simulator.spec.reference import scenario_reference, stack_table, unit_of
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec, preset_stack_names

ROOT = Path(__file__).resolve().parent.parent
GPT3 = ROOT / "scenarios" / "gpt3-175b-1024.yaml"
MOE = ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml"


def _row(text: str, section: str, key: str) -> list[str]:
    """The cells of ``key``'s row in ``section``'s table."""
    body = text.split(f"### `{section}`\n", 1)[1].split("\n### ", 1)[0]
    line = next(ln for ln in body.splitlines() if ln.startswith(f"| `{key}` |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


@pytest.fixture(scope="module")
def reference() -> str:
    return scenario_reference([GPT3, MOE])


def test_every_schema_field_has_a_row(reference: str) -> None:
    schema = Scenario.model_json_schema()
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", reference, re.M)}
    for node in [schema, *schema["$defs"].values()]:
        assert set(node.get("properties", {})) <= rows
    total = sum(len(n.get("properties", {})) for n in [schema, *schema["$defs"].values()])
    assert len(re.findall(r"^\| `[^`]+` \|", reference, re.M)) == total
    for section in ("model.mla", "parallel.overlap", "training.gradient_compression",
                    "variability.slow_gpus[]", "stack"):
        assert f"### `{section}`" in reference


def test_a_row_has_description_unit_default_allowed_and_example(reference: str) -> None:
    desc, unit, default, allowed, _example = _row(reference, "cluster",
                                                 "inter_node_bandwidth_GBps")[1:]
    assert "NIC" in desc and unit == "GB/s" and default == "`null`"
    assert allowed.startswith("number ≥ 0.001") and allowed.endswith("or `null`")
    assert _row(reference, "parallel", "tp")[3:] == ["`1`", "whole number > 0, ≤ 1e9", "`8`"]
    assert _row(reference, "parallel", "schedule")[4] == \
        "`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zbv`, `dualpipe`"
    assert _row(reference, "model", "layers")[3] == "required"
    # an example the first scenario leaves unset comes from the next one
    assert _row(reference, "model", "experts")[5] == "`256`"
    assert _row(reference, "model.mla", "kv_lora_rank")[5] == "`512`"


@pytest.mark.parametrize(("name", "unit"), [("storage_write_GBps", "GB/s"),
                                             ("link_latency_us", "µs"), ("restart_s", "s"),
                                             ("gpu_mtbf_h", "h"), ("dp_bucket_MB", "MB"),
                                             ("gpu_power_W", "W"), ("usd_per_gpu_hour", "USD"),
                                             ("hidden", ""), ("layers_per_stage", "")])
def test_units_come_from_the_names(name: str, unit: str) -> None:
    assert unit_of(name) == unit


def test_the_stack_table_has_every_preset_and_field() -> None:
    table = stack_table().splitlines()
    assert table[0] == "| field | " + " | ".join(f"`{n}`" for n in preset_stack_names()) + " |"
    fields = [ln.split("`")[1] for ln in table[2:]]
    assert fields == [f for f in StackSpec.model_fields if f not in ("preset", "name",
                                                                     "description")]


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    text = cli_reference()
    parsers = command_parsers()
    assert list(parsers) == list(help_lines())
    assert {"run", "plan", "calibrate", "validation"} <= set(parsers)  # plugins included
    for name, parser in parsers.items():
        section = text.split(f"## `clustersim {name}`\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in section, (name, option)


def _toy_add_parser(sub: Any) -> None:
    q = add_command(sub, "toy-import", "read another tool's configuration", "example:\n"
                    "  clustersim toy-import args.txt")
    q.add_argument("--flux", type=int, default=3, help="how much flux")
    q.set_defaults(func=lambda args: 0)


def test_a_command_registered_later_is_in_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = types.ModuleType("toy_command")
    toy.add_parser = _toy_add_parser  # type: ignore[attr-defined]
    monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, toy))
    text = cli_reference()
    assert "- [`toy-import`](#clustersim-toy-import): read another tool's configuration" in text
    section = text.split("## `clustersim toy-import`\n", 1)[1]
    assert "| `--flux` | `FLUX` | `3` | how much flux |" in section
    assert "clustersim toy-import args.txt" in section


def _hook() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "docs" / "hooks" /
                                                  "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_fills_every_marker_the_pages_hold() -> None:
    hook = _hook()
    pages = {p: p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md")}
    used = {m for m in hook.GENERATED if any(m in text for text in pages.values())}
    assert used == set(hook.GENERATED)  # no generator without its page
    config = {"config_file_path": str(ROOT / "mkdocs.yml")}
    page = ROOT / "docs" / "reference" / "cli.md"
    out = hook.on_page_markdown(pages[page], page=None, config=config, files=None)
    assert "<!-- generated:" not in out and "## `clustersim run`" in out
    for text in pages.values():  # every marker a page holds is one the hook knows
        for marker in re.findall(r"<!-- generated: [^>]*-->", text):
            assert marker in hook.GENERATED


def test_argparse_internals_the_reference_reads_exist() -> None:
    """The reference reads argparse's subparser action and its help pseudo-actions."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    sub.add_parser("x", help="an x")
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [(a.dest, a.help) for a in action._choices_actions] == [("x", "an x")]
