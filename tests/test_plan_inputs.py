"""``plan`` for real work: a model file, a stack preset, ``--set`` overrides (pins of
searched fields, settings of the others), and the chosen layout written as a scenario
that ``run`` takes unchanged and simulates to the plan's own step time."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from simulator.cli.main import main
from simulator.outputs.plots.search import pareto_figure
from simulator.search.candidates import PlanRequest, base_scenario, candidates
from simulator.spec.load import load_scenario

MODEL = "preset: llama2-7b\nlayers: 8\nseq_len: 1024\n"
FLAGS = ["--gpus", "8", "--system", "dgx-a100-80gb", "--global-batch", "32",
         "--micro-batches", "1,2", "--top", "1", "--workers", "1", "--no-cache"]


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "my-model.yaml"
    path.write_text(MODEL)
    return path


def test_pins_and_settings_from_set(model_file: Path) -> None:
    req = PlanRequest(str(model_file), 8, "dgx-a100-80gb", 32, micro_batches=(1, 2),
                      stack="megatron-core",
                      sets=("parallel.zero=1", "parallel.dp_bucket_MB=50"))
    base = base_scenario(req)
    assert (base.model.layers, base.model.seq_len, base.stack.preset) == (8, 1024,
                                                                          "megatron-core")
    free = candidates(PlanRequest(str(model_file), 8, "dgx-a100-80gb", 32,
                                  micro_batches=(1, 2)), base, variants=False)
    pinned = candidates(req, base, variants=False)
    zero = 7  # the zero column (candidate order: tp cp pp dp ep schedule v zero ...)
    assert {c[zero] for c in free} == {0, 1, 2, 3} and {c[zero] for c in pinned} == {1}
    assert len(pinned) * 4 == len(free)  # ZeRO is one factor of the product


@pytest.mark.parametrize(("sets", "needle"), [
    (["parallel.zero=5"], "--set = 'parallel.zero=5': no candidate layout has it; the search "
                          "tried 0, 1, 2, 3"),
    (["training.global_batch=8"], "the plan sets training.global_batch; use --global-batch"),
    (["parallel.dp_bucket_MB=-1"], "parallel.dp_bucket_MB = -1"),
])
def test_bad_set_is_one_line(sets: list[str], needle: str, model_file: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(model_file), *FLAGS, "--out", str(tmp_path / "o")]
    assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1, err


def test_a_whole_scenario_file_lends_its_model(tmp_path: Path) -> None:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "model": yaml.safe_load(MODEL)}))
    assert base_scenario(PlanRequest(str(path), 8, "dgx-a100-80gb", 32)).model.layers == 8


def test_written_scenario_runs_to_the_plans_figure(model_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out, best = tmp_path / "plan", tmp_path / "best.yaml"
    assert main(["plan", "--model", str(model_file), *FLAGS, "--stack", "megatron-core",
                 "--set", "parallel.zero=1", "--set", "parallel.dp_bucket_MB=50",
                 "--out", str(out), "--write-scenario", str(best)]) == 0
    assert f"wrote the chosen layout to {best}" in capsys.readouterr().out
    chosen = json.loads((out / "plan.json").read_text())["chosen"]
    s = load_scenario(best)
    assert (s.parallel.zero, s.parallel.dp_bucket_MB, s.stack.preset) == (1, 50,
                                                                          "megatron-core")
    assert (s.model.preset, s.model.layers) == ("llama2-7b", 8)  # the preset stays one
    run_dir = tmp_path / "run"
    assert main(["run", str(best), "--no-plots", "--out", str(run_dir)]) == 0
    results = json.loads((run_dir / "results.json").read_text())
    assert results["step_time_s"] == chosen["engine_step_time_s"]
    table = pd.read_csv(out / "plan.csv")
    labels = [t.get_text() for t in pareto_figure(table, {}).axes[0].get_legend().get_texts()]
    assert "chosen: the engine's fastest" in labels


def test_write_scenario_needs_a_yaml_name(model_file: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(model_file), *FLAGS, "--out", str(tmp_path / "o"),
                 "--write-scenario", str(tmp_path / "best.txt")]) == 2
    assert "must end in .yaml" in capsys.readouterr().err
