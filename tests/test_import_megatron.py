"""``clustersim import megatron``: Megatron-LM launch arguments -> a scenario.

The done-when: Megatron-LM's own GPT-3 175B launch script
(tests/data/imports/train_gpt3_175b_distributed.sh), with what the SC'21 run of the
bundled scenario adds to it, imports into a scenario that simulates exactly as
scenarios/gpt3-175b-1024.yaml does. Megatron-LM's defaults (validate_args in
megatron/training/arguments.py) are checked as oracles; every argument of its parser
is classed; what cannot be mapped is listed; bad input is one line and exit 2.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from simulator.api import simulate_scenario
from simulator.cli.main import main
from simulator.imports.megatron import LEGACY, arguments, classify, import_megatron
from simulator.imports.megatron_rules import RULES
from simulator.spec.load import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "data" / "imports" / "train_gpt3_175b_distributed.sh"
ARRAYS = ("DISTRIBUTED_ARGS", "GPT_MODEL_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS",
          "DATA_ARGS", "EVAL_AND_LOGGING_ARGS")
#: What the SC'21 run (the bundled scenario's header) had beyond the shipped script:
#: bf16 for --fp16, full recomputation, and GPT-2's tokenizer named (the script gives
#: only its vocabulary file)
SC21 = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--tokenizer-type", "GPT2BPETokenizer"]
BASE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--seq-length", "2048", "--micro-batch-size", "1", "--vocab-size", "50257"]

#: Megatron-Core's precision-aware optimizer, as it must be given (with the distributed one)
AWARE = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"]

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _script_words(quoted: bool) -> list[str]:
    """The launch line the script builds: its arrays expanded as written (``quoted``
    False: the script's own unquoted ``${ARR[@]}``, word-split) or each element one word."""
    if quoted:
        show = " ".join(f'"${{{a}[@]}}"' for a in ARRAYS[:1]) + " pretrain_gpt.py " + \
            " ".join(f'"${{{a}[@]}}"' for a in ARRAYS[1:])
        stub, tail = "torchrun() { :; }", f'; printf "%s\\n" {show}'
    else:
        stub, tail = 'torchrun() { printf "%s\\n" "$@"; }', ""
    cmd = f'{stub}; source "$0" CKPT TB gpt2-vocab.json gpt2-merges.txt DATA{tail}'
    done = subprocess.run(["bash", "-c", cmd, str(SCRIPT)], capture_output=True, text=True,
                          check=True)
    return done.stdout.splitlines()


def _import(tmp_path: Path, args: list[str], *options: str) -> tuple[int, Path]:
    out = tmp_path / "imported.yaml"
    rc = main(["import", "megatron", *options, "--out", str(out), "--", *args])
    return rc, out


def _sections(path: Path) -> dict[str, object]:
    s = load_scenario(path)
    dump = s.model_dump(exclude={"name", "description"})
    dump["parallel"].pop("overlap")
    dump["overlap_effective"] = s.stack.overlap(s.parallel.overlap).model_dump()
    return dump


@needs_bash
def test_gpt3_175b_imports_as_the_bundled_scenario(tmp_path: Path) -> None:
    words = [w.replace("--fp16", "--bf16") for w in _script_words(quoted=True)]
    rc, out = _import(tmp_path, words + SC21, "--nodes", "128", "--system",
                      "dgx-a100-80gb", "--stack", "megatron-2021")
    assert rc == 0
    bundled = ROOT / "scenarios" / "gpt3-175b-1024.yaml"
    assert _sections(out) == _sections(bundled)
    mine, theirs = (simulate_scenario(load_scenario(p), method="analytic")[0]
                    for p in (out, bundled))
    assert mine["step_time_s"] == theirs["step_time_s"]
    header = out.read_text().split("\nname:")[0]
    assert "--step-batch-size-schedule 0:16 2.4B:320" in header
    assert "torchrun --nnodes 1: the launcher's; --nodes 128 given instead" in header


@needs_bash
@pytest.mark.slow
def test_gpt3_175b_engine_step_equals_the_bundled(tmp_path: Path) -> None:
    words = [w.replace("--fp16", "--bf16") for w in _script_words(quoted=True)]
    _import(tmp_path, words + SC21, "--nodes", "128", "--system", "dgx-a100-80gb",
            "--stack", "megatron-2021")
    bundled = ROOT / "scenarios" / "gpt3-175b-1024.yaml"
    mine, theirs = (simulate_scenario(load_scenario(p))[0]
                    for p in (tmp_path / "imported.yaml", bundled))
    assert mine["step_time_s"] == theirs["step_time_s"]


@needs_bash
def test_the_scripts_unquoted_schedule_is_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped script expands its arrays unquoted, so the batch schedule reaches
    the parser as six words: argparse refuses the second, and so do we."""
    rc, out = _import(tmp_path, _script_words(quoted=False) + SC21, "--nodes", "128")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert len(err) == 1 and "'2.4B:320'" in err[0] and "--step-batch-size-schedule" in err[0]


def test_launcher_gives_the_gpu_count() -> None:
    argv = ["--nproc_per_node", "8", "--nnodes=4", "pretrain_gpt.py", *BASE,
            "--tensor-model-parallel-size", "8"]
    d = import_megatron(argv, "dgx-h100", None, None, "megatron-core", "x")
    assert d.get("cluster.nodes") == 4 and d.get("parallel.dp") == 4
    assert d.get("training.global_batch") == 4  # Megatron's default: micro · dp


def test_every_parser_argument_is_classed() -> None:
    table = arguments()
    assert len(table) > 800
    classes = {flag: classify(flag)[0] for flag in table}
    assert set(classes.values()) == {"mapped", "ignored", "unmapped"}
    read = {flag for rule in RULES for flag in rule.flags}
    assert read <= set(table) | set(LEGACY), read - set(table)  # no rule reads a typo
    assert classes["--data-path"] == "ignored" and classes["--lr"] == "ignored"
    assert classes["--moe-token-drop-policy"] == "unmapped"
    assert classes["--moe-token-dispatcher-type"] == "mapped"


@pytest.mark.parametrize(("extra", "field", "value"), [
    (["--swiglu"], "ffn_hidden", int(4 * 1024 * 2 / 3 / 64) * 64),  # validate_args
    ([], "ffn_hidden", 4 * 1024),
    (["--group-query-attention", "--num-query-groups", "4"], "kv_heads", 4),
    ([], "kv_heads", 16),
    ([], "vocab", 50304),  # 50257 up to a multiple of 128 · tp 1
    (["--tensor-model-parallel-size", "8"], "vocab", 51200),  # of 128 · 8
    (["--no-pad-vocab-size"], "vocab", 50257),
    (["--padded-vocab-size", "32000"], "vocab", 32000),
    (["--normalization", "RMSNorm", "--disable-bias-linear"], "norm", "rmsnorm"),
    (["--position-embedding-type", "rope"], "position", "rope"),
    (["--untie-embeddings-and-output-weights"], "tied_embeddings", False),
])
def test_megatron_defaults(tmp_path: Path, extra: list[str], field: str,
                           value: object) -> None:
    rc, out = _import(tmp_path, BASE + extra, "--gpus", "8")
    assert rc == 0
    assert getattr(load_scenario(out).model, field) == value


@pytest.mark.parametrize(("extra", "path", "value"), [
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size",
      "2", "--global-batch-size", "16"], ("parallel", "virtual_stages"), 2),
    (["--virtual-pipeline-model-parallel-size", "2", "--pipeline-model-parallel-size",
      "2", "--global-batch-size", "16"], ("parallel", "schedule"), "interleaved"),
    (["--use-distributed-optimizer"], ("parallel", "zero"), 1),
    (["--recompute-activations"], ("parallel", "recompute"), "selective"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"], ("parallel", "recompute_num_layers"), 2),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"], ("parallel", "recompute_num_layers"), None),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"], ("parallel", "recompute_group"), 2),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], ("parallel", "recompute_group"), None),
    # TransformerConfig.recompute_modules: the default core_attn is plain selective
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
     ("parallel", "recompute_modules"), None),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"],
     ("parallel", "recompute_modules"), ("layernorm", "mlp")),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mhc"],
     ("parallel", "recompute_modules"), ("core_attn",)),
    (["--overlap-grad-reduce"], ("parallel", "overlap", "dp"), True),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"],
     ("stack", "tp_overlap"), "pipelined"),
    (["--attention-backend", "unfused"], ("stack", "attention"), "unfused_fused_softmax"),
    (["--clip-grad", "0"], ("stack", "grad_clip"), False),
    (["--fp16"], ("training", "dtype"), "fp16"),
    (["--bf16", "--fp8-format", "hybrid"], ("stack", "fp8"), "delayed"),  # Megatron's default
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], ("stack", "fp8"),
     "current"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], ("stack", "fp8"),
     "blockwise"),
    ([], ("training", "dtype"), "fp32"),
    (["--global-batch-size", "64"], ("training", "global_batch"), 64),
    # the precision-aware optimizer (megatron/core/optimizer/optimizer_config.py)
    ([*AWARE, "--exp-avg-dtype", "bf16"], ("stack", "exp_avg_dtype"), "bf16"),
    ([*AWARE, "--exp-avg-sq-dtype", "fp8"], ("stack", "exp_avg_sq_dtype"), "fp8"),
    ([*AWARE, "--main-params-dtype", "fp16"], ("stack", "main_params_dtype"), "fp16"),
    ([*AWARE, "--main-params-dtype", "fp16"], ("stack", "param_remainders"), False),
    # bf16 parameters, fp32 master owned by TE's FusedAdam: store_param_remainders (default)
    (AWARE, ("stack", "param_remainders"), True),
    ([*AWARE, "--fp8-format", "hybrid"], ("stack", "param_remainders"), True),  # delayed
    # blockwise FP8: Megatron-Core keeps the fp32 master itself, whole
    ([*AWARE, "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
     ("stack", "param_remainders"), False),
    ([*AWARE, "--main-grads-dtype", "bf16"], ("stack", "main_grads"), "param"),
    ([*AWARE, "--main-grads-dtype", "bf16"], ("stack", "grad_reduce_dtype"), "param"),
    (["--bf16", "--use-distributed-optimizer"], ("stack", "exp_avg_dtype"), "fp32"),
])
def test_parallel_and_stack_flags(tmp_path: Path, extra: list[str], path: tuple[str, ...],
                                  value: object) -> None:
    rc, out = _import(tmp_path, BASE + extra, "--gpus", "8")
    assert rc == 0
    node: object = load_scenario(out).model_dump()
    for key in path:
        assert isinstance(node, dict)
        node = node[key]
    assert node == value


def test_unmapped_and_unknown_flags_are_listed(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--fp8-format", "hybrid", "--fp8-recipe", "custom", "--overlap-param-gather",
             "--moe-token-drop-policy",
             "position", "--tensor-model-paralel-size", "2", "--lr", "1e-4"]
    rc, out = _import(tmp_path, BASE + extra, "--gpus", "8")
    assert rc == 0
    header = out.read_text().split("\nname:")[0]
    err = capsys.readouterr().err
    for flag in ("--fp8-recipe custom", "--overlap-param-gather", "--moe-token-drop-policy",
                 "--tensor-model-paralel-size 2"):
        assert f"#   {flag}" in header and f"not mapped: {flag}" in err
    assert "did you mean --tensor-model-parallel-size" in header
    assert "--lr" not in header  # ignored by design: a hyperparameter
    yaml.safe_load(out.read_text())  # the comments keep it YAML


@pytest.mark.parametrize(("extra", "options", "words"), [
    (["--num-layers", "x"], ["--gpus", "8"], ["--num-layers", "'x'", "whole number"]),
    (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"],
     ["--gpus", "64"], ["tp(8) * cp(1) * pp(16) = 128", "64 GPUs"]),
    ([], [], ["--nodes N or --gpus N"]),
    (["--bf16", "--fp16"], ["--gpus", "8"], ["--bf16"]),
    (["--bf16", "--exp-avg-dtype", "bf16"], ["--gpus", "8"],
     ["--exp-avg-dtype", "'bf16'", "add --use-precision-aware-optimizer"]),
    (["--bf16", "--use-precision-aware-optimizer"], ["--gpus", "8"],
     ["--use-precision-aware-optimizer", "add --use-distributed-optimizer"]),
    ([*AWARE, "--optimizer", "sgd"], ["--gpus", "8"],
     ["--use-precision-aware-optimizer", "--optimizer sgd", "only with adam"]),
    ([*AWARE, "--exp-avg-dtype", "int8"], ["--gpus", "8"],
     ["--exp-avg-dtype", "'int8'", "fp32, fp16, bf16, fp8"]),
    ([*AWARE, "--main-params-dtype", "bf16"], ["--gpus", "8"], ["--main-params-dtype"]),
    ([*AWARE, "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"],
     ["--gpus", "8"], ["--main-grads-dtype", "--accumulate-allreduce-grads-in-fp32"]),
    (["--num-attention-heads", "12"], ["--gpus", "8"], ["model.hidden", "imported scenario"]),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               extra: list[str], options: list[str], words: list[str]) -> None:
    out = tmp_path / "imported.yaml"
    out.write_text("kept\n")
    rc = main(["import", "megatron", *options, "--out", str(out), "--", *BASE, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
    assert out.read_text() == "kept\n"  # nothing written over it


def test_kv_channels_apart_from_hidden_over_heads_is_the_head_width(tmp_path: Path) -> None:
    """Qwen3-32B as Megatron-LM launches it: 64 heads of --kv-channels 128 over a hidden
    size of 5120 (8192 wide attention), GQA with 8 groups."""
    args = ["--num-layers", "64", "--hidden-size", "5120", "--num-attention-heads", "64",
            "--kv-channels", "128", "--group-query-attention", "--num-query-groups", "8",
            "--ffn-hidden-size", "25600", "--swiglu", "--seq-length", "4096",
            "--micro-batch-size", "1", "--vocab-size", "151936", "--bf16",
            "--tensor-model-parallel-size", "8"]
    rc, out = _import(tmp_path, args, "--nodes", "1")
    assert rc == 0
    model = load_scenario(out).model
    assert (model.head_dim, model.q_width, model.hidden) == (128, 8192, 5120)
    rc, out = _import(tmp_path, [*BASE, "--kv-channels", "64"], "--nodes", "1")  # 1024/16
    assert rc == 0 and "head_dim" not in yaml.safe_load(out.read_text())["model"]
