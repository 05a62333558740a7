"""The package's shape: what the CLI imports, which way the packages depend on
each other, and that nothing cites a file outside the repository."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.cli.main import LAZY_COMMANDS, _parser, main

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("calibration", "torch", "matplotlib", "pandas")


def _all_commands() -> list[str]:
    """Every subcommand the parser offers (a new one is covered without editing here)."""
    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


COMMANDS = _all_commands()
SCENARIO = ROOT / "scenarios" / "gpt3-175b-1024.yaml"


def _modules_after(calls: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``calls`` (indented code that
    may use ``main``; its stdout is swallowed)."""
    code = ("import contextlib, io, json, sys\n"
            "from simulator.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"{calls}\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


#: What listing another package's commands may import: its package (a docstring) and the
#: table its ``clustersim.commands`` entry point names (simulator/cli/registry.py).
COMMAND_TABLES = ("calibration", "calibration.commands")


def _heavy(modules: set[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules if m not in COMMAND_TABLES} & set(HEAVY))


def _help(argv: list[str]) -> str:
    return (f"    try:\n        main({argv!r})\n    except SystemExit as exc:\n"
            "        assert exc.code == 0\n")


def test_top_level_help_imports_nothing_heavy() -> None:
    assert _heavy(_modules_after(_help(["--help"]))) == []


@pytest.mark.parametrize("argv", [["validate", str(SCENARIO)], ["presets"], ["schema"],
                                  ["memory", str(SCENARIO)]])
def test_light_commands_import_no_calibration_torch_matplotlib_pandas(argv: list[str]) -> None:
    assert _heavy(_modules_after(f"    assert main({argv!r}) == 0\n")) == []


def test_a_calibration_command_imports_its_module_only() -> None:
    loaded = {m for m in _modules_after(_help(["compare", "--help"]))
              if m.startswith("calibration.")}
    assert "calibration.measured.compare" in loaded
    assert not [m for m in loaded if m.startswith("calibration.microbench")]
    assert "calibration.measured.validation" not in loaded
    assert "torch" not in _modules_after(_help(["calibrate", "--help"]))


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert {"validate", "run", "memory", "presets", "schema", "sweep", "plot"} <= set(COMMANDS)
    assert set(LAZY_COMMANDS) <= set(COMMANDS)
    for name in COMMANDS:
        assert name in out
    for _, help_ in LAZY_COMMANDS.values():
        assert help_ in out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_subcommand_help_has_options_and_example(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: clustersim {name}" in out
    assert "example" in out
    if name in LAZY_COMMANDS:  # the module's full option list, not the one-line stub
        assert "--" in out.split("options:", 1)[1].replace("--help", "")


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_lazy_help_line_is_the_one_the_module_registers(name: str) -> None:
    module, help_ = LAZY_COMMANDS[name]
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(module).add_parser(sub)
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert registered == {name: help_}


def test_a_lazy_command_with_a_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--no-such-flag"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: clustersim compare: ")  # its own parser


# ------------------------------------------------------------ package dependencies


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_calibration_never_imports_the_cli() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                                  if m == "simulator.cli"
                                                  or m.startswith("simulator.cli."))
                 for p in sorted((ROOT / "calibration").rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_scan_sees_a_cli_import(tmp_path: Path) -> None:
    """The scan above can fail: it finds every spelling of importing the CLI."""
    for src in ("from simulator.cli import main", "import simulator.cli",
                "def f():\n    from simulator import cli\n"):
        path = tmp_path / "m.py"
        path.write_text(src)
        assert "simulator.cli" in _imported_modules(path), src


def test_the_microbenchmarks_do_not_import_the_measured_runs() -> None:
    for path in sorted((ROOT / "calibration" / "microbench").rglob("*.py")):
        bad = [m for m in _imported_modules(path) if m.startswith("calibration.measured")]
        assert bad == [], path


# ------------------------------------------------------------ citations


OUTSIDE = ("DESIGN" + ".md", "REFERENCE" + ".md")  # spelled apart: this file is tracked too


def test_no_tracked_file_cites_a_file_outside_the_repository() -> None:
    """Comments, docs and notebooks cite papers, framework sources or docs/, never the
    notes these files came from, which a reader of the repository does not have."""
    listed = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=ROOT,
                            check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    assert len(paths) > 50 and ROOT / "simulator" / "model" / "transformer.py" in paths
    hits = []
    for path in paths:
        if not path.is_file():  # deleted in the work tree
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        hits += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
    assert hits == []
