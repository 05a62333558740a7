"""Expert and context parallelism in the schema: Megatron-LM's rules
(megatron/core/parallel_state.py ``initialize_model_parallel``: tp · cp · pp divides the
world and dp is the rest; expert_tp · ep · pp divides the world, so ep is carved out
of the tp · cp · dp ranks of a stage), each broken rule one line naming every factor;
`validate` and `memory` work; `run` simulates expert parallelism and refuses context
parallelism (and the MoE combinations the expert pass does not build) with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from simulator.analysis.memory import memory_report
from simulator.cli.main import main
from simulator.errors import ScenarioError
from simulator.spec.load import apply_overrides, scenario_from_dict

MIXTRAL_64: dict[str, Any] = {
    "name": "mixtral-ep",
    "model": {"preset": "mixtral-8x7b", "seq_len": 4096},
    "cluster": {"system": "dgx-h100", "nodes": 8},
    "parallel": {"tp": 2, "pp": 4, "dp": 8, "ep": 8},
    "training": {"global_batch": 256, "micro_batch": 1},
}


def scenario(*sets: str) -> dict[str, Any]:
    """MIXTRAL_64 with ``--set``-style overrides."""
    return apply_overrides(MIXTRAL_64, list(sets))


def errors(d: dict[str, Any]) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(d)
    return info.value.lines()


def test_expert_parallel_scenario_validates() -> None:
    s = scenario_from_dict(scenario())
    assert (s.parallel.ep, s.parallel.etp, s.parallel.edp, s.parallel.world) == (8, 2, 1, 64)


@pytest.mark.parametrize(("sets", "line"), [
    (["parallel.dp=4"],
     "parallel = 'tp(2) * cp(1) * pp(4) * dp(4) = 32': must equal cluster.nodes(8) * "
     "gpus_per_node(8) = 64"),
    (["model.experts=6", "parallel.ep=4"],
     "parallel.ep = 4: model.experts (6) is not divisible by ep; use one of 1, 2, 3, 6"),
    (["parallel.ep=3"], "parallel.ep = 3: expert_tp(2) * ep(3) = 6 does not divide tp(2) * "
     "cp(1) * dp(8) = 16: expert-parallel ranks are carved out of a stage's tp * cp * dp ranks; "
     "use ep one of 1, 2, 4, 8"),
    (["parallel.dp=4", "parallel.cp=2", "parallel.expert_tp=4"],
     "parallel.ep = 8: expert_tp(4) * ep(8) = 32 does not divide tp(2) * cp(2) * dp(4) = 16"),
    (["parallel.cp=3", "parallel.dp=2", "cluster.nodes=6"],
     "parallel.cp = 3: model.seq_len (4096) is not divisible by 2 * cp = 6"),
    (["model.preset=llama2-7b", "parallel.tp=8", "parallel.pp=1"],
     "parallel.ep = 8: the model has no routed experts (model.experts = 0)"),
    (["model.experts_per_token=9"], "model.experts_per_token = 9: more than model.experts (8)"),
    (["model={preset: llama2-7b, shared_experts: 1}", "parallel.ep=1"],
     "model.shared_experts = 1: only for a mixture of experts"),
    (["model.first_dense_layers=32"], "model.first_dense_layers = 32: leaves no MoE layer"),
])
def test_each_rule_is_one_line_naming_the_factors(sets: list[str], line: str) -> None:
    lines = errors(scenario(*sets))
    assert any(got.startswith(line) for got in lines), lines
    assert all("\n" not in got for got in lines)


def test_ep_fix_lists_the_degrees_that_fit() -> None:
    (line,) = [x for x in errors(scenario("parallel.ep=16", "parallel.expert_tp=1",
                                          "parallel.dp=4", "cluster.nodes=4"))
               if "does not divide" in x]
    assert line.endswith("use ep one of 1, 2, 4, 8")


def test_cp_with_sequence_parallel_needs_whole_tp_chunks() -> None:
    lines = errors(scenario("parallel.tp=4", "parallel.cp=2", "parallel.dp=2", "parallel.ep=4",
                            "parallel.sequence_parallel=true", "model.seq_len=12"))
    assert any(x.startswith("parallel.cp = 2: seq_len / cp = 6 is not divisible by tp(4)")
               for x in lines)


def test_memory_under_expert_parallelism() -> None:
    """Experts split over expert_tp · ep; the rest over tp; ZeRO-1 shards expert optimizer
    states over edp and the rest over dp · cp."""
    base = scenario_from_dict(scenario("parallel.ep=1"))
    split = scenario_from_dict(scenario())
    zero = scenario_from_dict(scenario("parallel.zero=1"))
    for b, e, z in zip(memory_report(base), memory_report(split), memory_report(zero),
                       strict=True):
        assert e.weights < b.weights / 3
        assert e.activations == b.activations
        assert z.optimizer < e.optimizer
    from simulator.model import moe

    mid = memory_report(split)[1]  # 8 layers, no embedding or head
    experts = 8 * moe.expert_params(split.model, 0)
    dense = 8 * moe.layer_params(split.model, 0) - experts
    assert mid.weights == pytest.approx(2 * (dense / 2 + experts / (2 * 8)), rel=1e-12)


def test_memory_under_context_parallelism() -> None:
    one = scenario_from_dict(scenario("parallel.ep=1"))
    two = scenario_from_dict(scenario("parallel.ep=1", "parallel.cp=2", "parallel.dp=4"))
    a, b = memory_report(one)[1], memory_report(two)[1]
    assert b.weights == a.weights
    assert b.activations == pytest.approx(a.activations / 2, rel=1e-12)


@pytest.mark.parametrize(("sets", "field"), [
    (["parallel.ep=1", "parallel.cp=2", "parallel.dp=4"], "parallel.cp = 2: not yet simulated"),
    ([], "parallel.sequence_parallel = False: a mixture of experts with tp(2) > 1 needs "
     "sequence parallelism"),
    (["parallel.sequence_parallel=true", "parallel.zero=2", "parallel.zero_offload=true"],
     "parallel.zero_offload = True: not yet simulated for a mixture of experts"),
    (["parallel.sequence_parallel=true", "parallel.zero=3", "stack=deepspeed"],
     "parallel.zero = 3: a mixture of experts under ZeRO-3 with module units"),
])
def test_run_refuses_what_has_no_workload_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             sets: list[str], field: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario(*sets)))
    # valid, and judged by the memory model (whether or not it fits), yet not run
    assert main(["validate", str(path), "--allow-oom"]) == 0
    assert main(["memory", str(path), "--allow-oom"]) == 0
    capsys.readouterr()
    for method in ("engine", "analytic"):
        assert main(["run", str(path), "--method", method, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert any(line.startswith(f"error: {field}") for line in err.splitlines()), err
        assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_validate_names_the_new_degrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario("parallel.cp=2", "parallel.dp=4")))
    assert main(["validate", str(path)]) == 0
    assert "64 GPUs, tp 2 · pp 4 · dp 4 · cp 2 · ep 8," in capsys.readouterr().out


def test_unknown_key_in_the_optional_mla_section_lists_its_keys() -> None:
    lines = errors(scenario("model.preset=deepseek-v3", "model.mla.v_head_dims=8"))
    assert "model.mla.v_head_dims = 8: unknown key; did you mean 'v_head_dim'? valid keys " \
        "here: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim" in lines
