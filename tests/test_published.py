"""Published runs beside the simulation (``clustersim validate-runs``): the table is read
strictly, each row becomes the scenario it describes or a stated reason, is simulated in
the row's own unit, and the errors are grouped by regime."""

from __future__ import annotations

import csv
import io
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from simulator.cli.main import main
from simulator.errors import UserError
from simulator.published.compare import compare_row, compare_rows, regime_summary
from simulator.published.mapping import Unexpressed, scenario_data
from simulator.published.report import totals
from simulator.published.rows import COLUMNS, read_rows
from simulator.spec.load import scenario_from_dict

ROOT = Path(__file__).resolve().parent.parent
DEV_SET = ROOT / "docs" / "validation" / "published" / "llm-foundry.csv"


def _rows() -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(DEV_SET.read_text())))


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _pick(**where: str) -> dict[str, str]:
    return next(r for r in _rows() if all(r[k] == v for k, v in where.items()))


def test_the_development_set_reads_whole() -> None:
    rows = read_rows(DEV_SET)
    assert len(rows) == 216
    assert {r.unit for r in rows} == {"tokens/s/GPU"}


def test_a_row_becomes_the_scenario_it_describes() -> None:
    [row] = [r for r in read_rows(DEV_SET) if r.name ==
             "llmfoundry_h100_bf16_large_mpt70b_seq2048_512gpu_mbs8_ga1"]
    data = scenario_data(row)
    assert data["cluster"] == {"system": "dgx-h100", "nodes": 64, "gpus_per_node": 8}
    assert data["parallel"]["dp"] == 512 and data["parallel"]["zero"] == 3
    assert data["parallel"]["recompute"] == "full"
    assert data["training"] == {"global_batch": 4096, "micro_batch": 8, "dtype": "bf16"}
    assert data["stack"] == {"preset": "composer-fsdp1", "attention": "flash2"}
    model = data["model"]
    assert (model["layers"], model["hidden"], model["heads"], model["vocab"]) == \
        (80, 8192, 64, 50368)
    assert (model["activation"], model["norm"], model["bias"], model["position"]) == \
        ("gelu", "layernorm", True, "learned")
    s = scenario_from_dict(data)
    assert s.parallel.world == 512 and s.microbatches == 1


def test_an_fp8_row_trains_bf16_with_delayed_scaling_fp8_linears() -> None:
    """Composer's amp_fp8: Transformer Engine's DelayedScaling over bf16, its linears
    called without is_first_microbatch (a weight cast every forward)."""
    [row] = [r for r in read_rows(DEV_SET) if r.dtype == "amp_fp8"][:1]
    s = scenario_from_dict(scenario_data(row))
    assert (s.training.dtype, s.stack.fp8, s.stack.fp8_weight_cast) == \
        ("bf16", "delayed", "microbatch")
    bf16 = scenario_from_dict(scenario_data(row.model_copy(update={"dtype": "amp_bf16"})))
    assert bf16.stack.fp8 == "none"


def test_the_attention_implementation_a_row_states_is_the_stacks_kernel() -> None:
    """llm-foundry's ``attn_impl``: triton is flash-attn's Triton kernel, flash is
    flash-attn (1.x: FlashAttention v1), torch the unfused matmul-softmax-matmul; a name
    the framework does not have is a stated reason; none stated, the preset's own."""
    [row] = [r for r in read_rows(DEV_SET) if r.name ==
             "llmfoundry_h100_bf16_large_mpt70b_seq2048_512gpu_mbs8_ga1"]
    for flags, kernel in (("attn_impl triton", "flash_triton"), ("attn_impl=flash", "flash2"),
                          ("flash-attn==1.0.9, attn_impl: flash", "flash1"),
                          ("attn_impl flash with flash-attn 2.4.2", "flash2"),
                          ("attn_impl torch", "unfused")):
        s = scenario_from_dict(scenario_data(row.model_copy(update={"other_flags": flags})))
        assert s.stack.attention == kernel, flags
    assert "attention" not in scenario_data(row.model_copy(update={"other_flags": ""}))["stack"]
    with pytest.raises(Unexpressed, match="attn_impl 'xformers'"):
        scenario_data(row.model_copy(update={"other_flags": "attn_impl xformers"}))


def test_the_development_set_runs_the_kernel_its_commit_ran() -> None:
    """Every table but Jan 2024's large-scale one ran submit_benchmarks.py's default
    ``attn_impl`` of its day, triton; that table's sweep.py set flash (flash-attn 2.4.2)
    for 1B, 3B, 7B and 70B and triton for 13B and 30B."""
    kernels = {r.name: scenario_data(r)["stack"]["attention"] for r in read_rows(DEV_SET)}
    large = {n: k for n, k in kernels.items() if "_large_" in n}
    assert {k for n, k in kernels.items() if n not in large} == {"flash_triton"}
    assert {n for n, k in large.items() if k == "flash_triton"} == \
        {n for n in large if "_mpt13b_" in n or "_mpt30b_" in n}
    assert sum(k == "flash2" for k in large.values()) == 12


def test_fsdp_hybrid_shard_shards_within_a_node() -> None:
    """FSDP1's HYBRID_SHARD without a device mesh: ZeRO-3 over the node's 8 GPUs,
    replicated across the 64 nodes (``_init_intra_and_inter_node_groups``); on one node
    it is full sharding."""
    [row] = [r for r in read_rows(DEV_SET) if r.name ==
             "llmfoundry_h100_bf16_large_mpt70b_seq2048_512gpu_mbs8_ga1"]
    hybrid = row.model_copy(update={"zero_or_fsdp": "FSDP HYBRID_SHARD"})
    s = scenario_from_dict(scenario_data(hybrid))
    assert (s.parallel.zero, s.parallel.dp, s.parallel.dp_shard) == (3, 512, 8)
    [small] = [r for r in read_rows(DEV_SET) if r.gpus == 8][:1]
    one = small.model_copy(update={"zero_or_fsdp": "FSDP HYBRID_SHARD"})
    assert scenario_data(one)["parallel"]["dp_shard"] == 8
    assert "dp_shard" not in scenario_data(row)["parallel"]
    with pytest.raises(Unexpressed, match="with tp, pp or cp"):
        scenario_data(hybrid.model_copy(update={"tp": 2, "dp": 256}))


def test_fsdp_shard_grad_op_is_zero3_kept_gathered_through_the_backward() -> None:
    """SHARD_GRAD_OP (torch/distributed/fsdp/api.py): parameters sharded outside
    computation, gathered before the forward and kept until after the backward: ZeRO-3
    without resharding after forward, so each unit is gathered once a micro-batch (L + 1
    gathers, none after the step); FULL_SHARD reshards."""
    [row] = [r for r in read_rows(DEV_SET) if r.name ==
             "llmfoundry_h100_bf16_large_mpt1b_seq2048_128gpu_mbs12_ga1"]
    assert "SHARD_GRAD_OP" in row.zero_or_fsdp
    s = scenario_from_dict(scenario_data(row))
    assert (s.parallel.zero, s.parallel.reshard_after_forward) == (3, False)
    full = scenario_from_dict(scenario_data(row.model_copy(
        update={"zero_or_fsdp": "FSDP FULL_SHARD (mixed precision mode DEFAULT)"})))
    assert (full.parallel.zero, full.parallel.reshard_after_forward) == (3, True)
    from simulator.strategies.zero3.counts import zero3_collective_counts
    assert zero3_collective_counts(s, 0)["all_gather"] == s.model.layers + 1


def test_fsdp_mixed_precision_pure_reduces_gradients_in_bf16() -> None:
    [row] = [r for r in read_rows(DEV_SET) if "PURE" in r.zero_or_fsdp][:1]
    s = scenario_from_dict(scenario_data(row))
    assert (s.stack.main_grads, s.stack.grad_reduce_dtype) == ("fp32", "param")
    [default] = [r for r in read_rows(DEV_SET) if "DEFAULT" in r.zero_or_fsdp][:1]
    s = scenario_from_dict(scenario_data(default))
    assert (s.stack.main_grads, s.stack.grad_reduce_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("dtype", "amp_fp4", "expected bf16, fp16, fp32 or fp8"),
    ("zero_or_fsdp", "FSDP _HYBRID_SHARD_ZERO2", "hybrid sharding of gradients only"),
    ("framework", "nanotron", "has no stack preset"),
    ("gpu", "MI300X", "has no system preset"),
    ("recompute", "every 4th layer", "only full, selective or none"),
])
def test_what_cannot_be_said_has_a_reason(field: str, value: str, reason: str) -> None:
    row = read_rows(DEV_SET)[0].model_copy(update={field: value})
    with pytest.raises(Unexpressed, match=reason):
        scenario_data(row)
    entry = compare_row(row, "analytic")
    assert math.isnan(entry["error"]) and reason in entry["reason"]


def test_a_row_is_simulated_in_its_own_unit() -> None:
    [row] = [r for r in read_rows(DEV_SET) if r.gpus == 8 and "125m" in r.name][:1]
    entry = compare_row(row, "analytic")
    assert entry["reason"] == "" and entry["fits"] is True
    assert entry["error"] == pytest.approx(entry["simulated"] / row.measured - 1)
    from simulator.api import simulate_scenario

    results, _ = simulate_scenario(scenario_from_dict(scenario_data(row)), "analytic")
    assert entry["simulated"] == pytest.approx(results["tokens_per_s"] / 8)
    step = row.model_copy(update={"unit": "s/step", "measured": 1.0})
    assert compare_row(step, "analytic")["simulated"] == pytest.approx(results["step_time_s"])
    odd = row.model_copy(update={"unit": "furlongs"})
    assert "unit 'furlongs'" in compare_row(odd, "analytic")["reason"]


def test_errors_are_grouped_by_regime() -> None:
    rows = [r for r in read_rows(DEV_SET) if r.gpus <= 16][:12]
    with ThreadPoolExecutor(2) as pool:
        table = compare_rows(rows, "analytic", pool)
    regimes = regime_summary(table)
    assert set(regimes["regime"]) == {"gpu", "model size", "sequence length", "GPUs",
                                      "tokens per micro-batch", "checkpointing", "dtype"}
    done = table[table["error"].notna()]
    for regime, group in regimes.groupby("regime"):
        assert group["rows"].sum() == len(done), regime  # each row in one group
    assert totals(table)["compared"] == len(done)
    assert (done["micro_batch_tokens"] == [r.micro_batch * r.seq_len for r in rows
                                           if r.name in set(done["name"])]).all()
    assert ((done["exposed_comm"] >= 0) & (done["exposed_comm"] < 1)).all()


def test_a_bad_cell_is_one_line_naming_the_row_and_column(tmp_path: Path) -> None:
    row = _pick(name="llmfoundry_h100_bf16_large_mpt70b_seq2048_512gpu_mbs8_ga1")
    path = _write(tmp_path / "bad.csv", [{**row, "gpus": "many"}])
    with pytest.raises(UserError) as exc:
        read_rows(path)
    (line,) = exc.value.lines()
    assert "llmfoundry_h100_bf16_large_mpt70b_seq2048_512gpu_mbs8_ga1" in line
    assert "column gpus" in line
    missing = tmp_path / "missing.csv"
    missing.write_text("name,gpu\nx,H100\n")
    with pytest.raises(UserError, match="missing column"):
        read_rows(missing)


def test_the_command_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    small = [r for r in _rows() if r["gpus"] == "8"][:3]
    hybrid = {**small[0], "name": "hybrid", "zero_or_fsdp": "FSDP _HYBRID_SHARD_ZERO2"}
    table = _write(tmp_path / "runs.csv", [*small, hybrid])
    out = tmp_path / "out"
    assert main(["validate-runs", str(table), "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "4 row(s): 3 compared, 1 not expressed" in printed
    assert "hybrid sharding" in printed
    for name in ("runs.csv", "regimes.csv", "runs.md", "summary.json", "scatter.png"):
        assert (out / name).stat().st_size > 0
    assert "## By regime" in (out / "runs.md").read_text()


def test_a_bad_table_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.csv"
    path.write_text("not,a,runs,table\n1,2,3,4\n")
    assert main(["validate-runs", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "missing column" in capsys.readouterr().err
