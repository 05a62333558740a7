"""What a user reads about the scenario before running it: every field of the JSON
Schema (``clustersim schema``, which editors show on hover) carries a description from
the typed spec's own field docstrings; other tools' names for a key point at ours;
``parallel.fsdp: true`` is read as ZeRO-3 with a warning; ``clustersim presets`` lists
the training stacks beside the models and systems."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simulator.cli.main import main
from simulator.spec.load import load_scenario
from simulator.spec.stack import preset_stack_names

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "llama2-7b-8gpu-ddp.yaml"


def _properties(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property of the schema and of each of its definitions, by dotted name."""
    for owner, node in [("Scenario", schema), *schema.get("$defs", {}).items()]:
        for name, prop in node.get("properties", {}).items():
            yield f"{owner}.{name}", prop


def test_every_schema_property_has_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    props = dict(_properties(schema))
    assert len(props) > 100  # the sections and their fields, not just the top level
    missing = [name for name, prop in props.items() if not prop.get("description", "").strip()]
    assert missing == []
    # the text is the field's own docstring (units included), not a generated title
    assert "GB/s" in props["ClusterSpec.inter_node_bandwidth_GBps"]["description"]
    assert "ZeRO" in props["ParallelSpec.zero"]["description"]


def test_presets_lists_the_stacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "stacks" in out
    stacks = out[out.index("stacks"):].splitlines()[1:]
    assert [line.split()[0] for line in stacks] == preset_stack_names()
    assert len(stacks) >= 6


@pytest.mark.parametrize(("key", "ours"), [
    ("parallel.tensor", "tp"), ("parallel.pipeline", "pp"), ("parallel.data_parallel", "dp"),
    ("parallel.gradient_checkpointing", "recompute"), ("parallel.zero_stage", "zero"),
    ("training.micro_batch_size", "micro_batch"), ("model.num_layers", "layers"),
    ("model.hidden_size", "hidden"), ("model.num_key_value_heads", "kv_heads"),
])
def test_other_tools_names_point_at_ours(key: str, ours: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(SCENARIO), "--set", f"{key}=2"]) == 2
    err = capsys.readouterr().err
    assert f"error: {key} = 2: unknown key; did you mean '{ours}'?" in err


@pytest.fixture
def no_zero(tmp_path: Path) -> Path:
    """A scenario that does not name a ZeRO stage."""
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmodel: {preset: tiny-gpt}\ncluster: {system: dgx-h100, nodes: 1}\n"
                    "parallel: {dp: 8}\ntraining: {global_batch: 16}\n")
    return path


def test_fsdp_true_is_zero3_with_a_warning(no_zero: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(no_zero), "--set", "parallel.fsdp=true"]) == 0
    err = capsys.readouterr().err
    assert "warning: parallel.fsdp = true: read as parallel.zero: 3" in err
    alias = load_scenario(no_zero, ["parallel.fsdp=true"])
    zero3 = load_scenario(no_zero, ["parallel.zero=3"])
    assert alias.parallel.zero == 3
    assert alias.to_dict() == zero3.to_dict()  # same scenario echoed, same cache key
    assert main(["validate", str(no_zero), "--set", "parallel.zero=3"]) == 0
    assert "fsdp" not in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [["parallel.fsdp=true", "parallel.zero=1"],
                                       ["parallel.fsdp=false", "parallel.zero=3"]])
def test_fsdp_against_zero_is_one_error(no_zero: Path, overrides: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["validate", str(no_zero)]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: parallel.fsdp = ")
    assert "contradicts parallel.zero" in err[0]
