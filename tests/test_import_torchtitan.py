"""``clustersim import torchtitan``: a torchtitan TOML job config -> a scenario.

The done-when: torchtitan's own llama3_8b.toml (tests/data/imports/) imports into a
scenario that simulates exactly as the hand-written
scenarios/llama3-8b-8xh100-torchtitan.yaml. The llama3 flavors' SwiGLU widths are
checked against the published checkpoints' (config.json intermediate_size); every
JobConfig key is classed; what cannot be mapped is listed; a malformed file or value
is one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.imports.torchtitan import MAPPED, classify, known_keys, llama3_fields
from simulator.spec.load import load_scenario
from simulator.spec.model_spec import load_preset_model

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "imports"
BUNDLED = ROOT / "scenarios" / "llama3-8b-8xh100-torchtitan.yaml"
SMALL = """[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 2
seq_len = 512
"""


def _import(tmp_path: Path, config: Path, *options: str) -> tuple[int, Path]:
    out = tmp_path / "imported.yaml"
    return main(["import", "torchtitan", str(config), *options, "--out", str(out)]), out


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_llama3_8b_imports_as_the_bundled_scenario(tmp_path: Path) -> None:
    rc, out = _import(tmp_path, DATA / "llama3_8b.toml", "--gpus", "8")
    assert rc == 0
    mine, theirs = load_scenario(out), load_scenario(BUNDLED)
    # its "op" policy is the per-op one (recompute: op), which the bundled file, written
    # when op-level SAC was simulated as selective, takes at the merge
    theirs = theirs.model_copy(update={"parallel": theirs.parallel.model_copy(
        update={"recompute": "op"})})
    assert mine.model_dump(exclude={"name", "description"}) == \
        theirs.model_dump(exclude={"name", "description"})
    for method in ("analytic", "engine"):
        a, b = (simulate_scenario(s, method=method)[0] for s in (mine, theirs))
        assert a["step_time_s"] == b["step_time_s"]
        assert a["memory"] == b["memory"]


def test_llama3_70b_layout(tmp_path: Path) -> None:
    rc, out = _import(tmp_path, DATA / "llama3_70b.toml", "--nodes", "8")
    assert rc == 0
    s = load_scenario(out)
    assert s.model.preset == "llama3-70b" and s.model.seq_len == 8192
    par = s.parallel
    assert (par.tp, par.pp, par.dp, par.zero, par.sequence_parallel) == (8, 1, 8, 3, True)
    assert par.recompute == "full"
    assert (s.training.micro_batch, s.training.global_batch) == (8, 64)  # 8 per DP rank


@pytest.mark.parametrize(("flavor", "preset", "intermediate"), [
    ("8B", "llama3-8b", 14336), ("70B", "llama3-70b", 28672), ("405B", "llama3-405b", 53248)])
def test_flavors_are_the_published_models(flavor: str, preset: str, intermediate: int) -> None:
    """Meta's config.json intermediate_size for Llama 3.1 8B / 70B / 405B."""
    fields = llama3_fields(flavor, 8192)
    assert fields["ffn_hidden"] == intermediate
    bundled = load_preset_model(preset).model_dump(exclude={"preset"})
    assert {k: bundled[k] for k in fields} == fields


def test_every_job_config_key_is_classed() -> None:
    keys = known_keys()
    assert len(keys) > 100
    assert keys >= MAPPED, MAPPED - keys  # no rule reads a typo
    classes = {classify(k)[0] for k in keys}
    assert classes == {"mapped", "ignored", "unmapped"}
    assert classify("checkpoint.folder")[0] == "ignored"
    assert classify("training.enable_cpu_offload")[0] == "unmapped"
    assert classify("training.no_such_key")[0] == "unknown"


def test_unmapped_unknown_and_legacy_keys_are_listed(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    text = SMALL + "enable_cpu_offload = true\nbogus = 3\n[float8]\nenable_float8_linear = true\n"
    rc, out = _import(tmp_path, _toml(tmp_path, text), "--gpus", "8")
    assert rc == 0
    header = out.read_text().split("\nname:")[0]
    err = capsys.readouterr().err
    for key in ("training.enable_cpu_offload True", "training.bogus 3",
                "float8.enable_float8_linear True"):
        assert f"#   {key}" in header and f"not mapped: {key}" in err
    assert "not a key of torchtitan's JobConfig" in header
    yaml.safe_load(out.read_text())


@pytest.mark.parametrize(("extra", "path", "value"), [
    ("[parallelism]\ndata_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 8\n",
     ("parallel", "zero"), 0),
    ("[parallelism]\ndata_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 8\n",
     ("training", "dtype"), "fp32"),  # no FSDP: no MixedPrecisionPolicy
    ("[parallelism]\ndata_parallel_shard_degree = 4\ndata_parallel_replicate_degree = 2\n",
     ("parallel", "dp_shard"), 4),  # HSDP: shard within groups of 4, replicate over 2
    ("[parallelism]\ndata_parallel_replicate_degree = 2\n", ("parallel", "dp_shard"), 4),
    ("[parallelism]\ndata_parallel_shard_degree = 8\n", ("parallel", "dp_shard"), None),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"GPipe\"\n",
     ("parallel", "schedule"), "gpipe"),
    ("[parallelism]\npipeline_parallel_degree = 2\n", ("training", "micro_batch"), 1),
    ("[parallelism]\npipeline_parallel_degree = 2\n", ("parallel", "reshard_after_forward"),
     False),
    ("[compile]\nenable = true\ncomponents = [\"model\"]\n", ("stack", "fusions"),
     ("bias_act", "bias_dropout_add", "rope")),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"1\"\n",
     ("parallel", "recompute"), "full"),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"1\"\n",
     ("parallel", "recompute_every"), None),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"3\"\n",
     ("parallel", "recompute_every"), 3),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"3\"\n",
     ("parallel", "recompute"), "full"),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"op\"\n",
     ("parallel", "recompute"), "op"),
    ("[optimizer]\nimplementation = \"for-loop\"\n", ("stack", "optimizer"), "per_tensor"),
    # torchtitan #2732: fused AdamW with both moments in bf16
    ("[optimizer]\nimplementation = \"fused_opt_states_bf16\"\n", ("stack", "optimizer"),
     "fused"),
    ("[optimizer]\nimplementation = \"fused_opt_states_bf16\"\n", ("stack", "exp_avg_dtype"),
     "bf16"),
    ("[optimizer]\nimplementation = \"fused_opt_states_bf16\"\n",
     ("stack", "exp_avg_sq_dtype"), "bf16"),
    ("[optimizer]\nimplementation = \"fused\"\n", ("stack", "exp_avg_sq_dtype"), "fp32"),
    # torch's _AllGatherRotater gathers K/V once; _AllToAllRotater passes them to the next
    # rank each ring step: the ring of point-to-point exchanges
    ("[parallelism]\ncontext_parallel_degree = 2\n", ("parallel", "cp_comm_type"), "allgather"),
    ("[parallelism]\ncontext_parallel_degree = 2\ncontext_parallel_rotate_method = "
     "\"alltoall\"\n", ("parallel", "cp_comm_type"), "p2p"),
])
def test_keys(tmp_path: Path, extra: str, path: tuple[str, ...], value: object) -> None:
    rc, out = _import(tmp_path, _toml(tmp_path, SMALL + extra), "--gpus", "8")
    assert rc == 0
    node: object = load_scenario(out).model_dump()
    for key in path:
        assert isinstance(node, dict)
        node = node[key]
    assert node == value


@pytest.mark.parametrize(("text", "options", "words"), [
    ("[model\nname = 1\n", ["--gpus", "8"], ["job.toml", "not valid TOML"]),
    (SMALL + "[parallelism]\ntensor_parallel_degree = \"8\"\n", ["--gpus", "8"],
     ["parallelism.tensor_parallel_degree", "expected int"]),
    (SMALL + "[parallelism]\ntensor_parallel_degree = 8\n", ["--gpus", "12"],
     ["--gpus", "multiple of 8"]),
    (SMALL + "[parallelism]\ntensor_parallel_degree = 3\n", ["--gpus", "8"],
     ["tp(3) * cp(1) * pp(1) = 3", "8 GPUs"]),
    (SMALL + "[parallelism]\ndata_parallel_replicate_degree = 3\n", ["--gpus", "8"],
     ["data_parallel_replicate_degree", "8 data-parallel ranks"]),
    (SMALL.replace("debugmodel", "13B"), ["--gpus", "8"], ["model.flavor", "'13B'"]),
    (SMALL + "[activation_checkpoint]\nmode = \"sometimes\"\n", ["--gpus", "8"],
     ["activation_checkpoint.mode"]),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                               options: list[str], words: list[str]) -> None:
    out = tmp_path / "imported.yaml"
    out.write_text("kept\n")
    rc = main(["import", "torchtitan", str(_toml(tmp_path, text)), *options, "--out",
               str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
    assert out.read_text() == "kept\n"


def test_not_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["import", "torchtitan", str(tmp_path), "--gpus", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a directory" in err[0]

