"""``clustersim import torchtitan`` of a mixture of experts: torchtitan's deepseek_v3
flavors (torchtitan/models/deepseek_v3/__init__.py ``deepseekv3_args``) are the
published DeepSeek models, and FSDP with ``expert_parallel_degree`` maps to ZeRO-3
with ep, which the simulator runs (each MoE layer's experts sharded over the expert
data-parallel group, as torchtitan's ``apply_fsdp`` does)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from simulator.cli.main import main
from simulator.imports.torchtitan_moe import DEEPSEEK_V3, deepseek_v3_fields
from simulator.model import transformer as mdl
from simulator.spec.load import load_scenario
from simulator.spec.model_spec import ModelSpec

DEEPSEEK_16B = """[model]
name = "deepseek_v3"
flavor = "16B"
[training]
local_batch_size = 4
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
expert_parallel_degree = 8
"""


def _import(tmp_path: Path, text: str, *options: str) -> tuple[int, Path]:
    config, out = tmp_path / "job.toml", tmp_path / "imported.yaml"
    config.write_text(text)
    return main(["import", "torchtitan", str(config), *options, "--out", str(out)]), out


@pytest.mark.parametrize(("flavor", "total", "active"), [
    ("16B", 15.7, 2.4),  # DeepSeek-V2-Lite's model card: 15.7B total, 2.4B activated
    ("236B", 236, 21),  # DeepSeek-V2 (arXiv:2405.04434): 236B total, 21B activated
    ("671B", 671, 37),  # DeepSeek-V3 (arXiv:2412.19437): 671B total, 37B activated
])
def test_flavors_are_the_published_models(flavor: str, total: float, active: float) -> None:
    """Parameters in billions to the published figures' rounding; the active ones
    (without the input embedding, as DeepSeek counts them) within 3%: 2.45, 20.85 and
    36.63 B."""
    spec = ModelSpec.model_validate(deepseek_v3_fields(flavor, 4096))
    digits = len(str(total).split(".")[1]) if "." in str(total) else 0
    assert round(mdl.param_count(spec) / 1e9, digits) == total
    assert mdl.active_param_count(spec, embedding=False) / 1e9 == pytest.approx(active,
                                                                                rel=0.03)


def test_671b_imports_as_the_deepseek_v3_preset(tmp_path: Path) -> None:
    text = DEEPSEEK_16B.replace('"16B"', '"671B"').replace("expert_parallel_degree = 8",
                                                           "expert_parallel_degree = 64")
    rc, out = _import(tmp_path, text, "--nodes", "32")
    assert rc == 0
    assert yaml.safe_load(out.read_text())["model"] == {"preset": "deepseek-v3"}


def test_fsdp_with_expert_parallelism_maps_to_zero3_with_ep_and_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _import(tmp_path, DEEPSEEK_16B, "--nodes", "8")
    assert rc == 0
    assert "model.flavor 16B: flex attention" in capsys.readouterr().err  # listed
    s = load_scenario(out)
    par = s.parallel
    assert (par.dp, par.zero, par.ep, par.etp, par.edp) == (64, 3, 8, 1, 8)
    assert s.model.experts == 64 and s.model.first_dense_layers == 1
    assert main(["run", str(out), "--method", "analytic", "--out", str(tmp_path / "o")]) == 0
    assert "error" not in capsys.readouterr().err


def test_an_unknown_flavor_is_one_line(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = _import(tmp_path, DEEPSEEK_16B.replace('"16B"', '"7B"'), "--nodes", "8")
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.flavor" in err and ", ".join(DEEPSEEK_V3) in err
    assert "Traceback" not in err
