"""``clustersim fake-memory``: PyTorch's own accounting of an FSDP2 step
(FakeTensorMode, a fake process group, FSDPMemTracker) beside the simulator's table.

The default run is a tiny Llama on two fake ranks (a few seconds); the 8B scenario of
torchtitan on 8 H100 is marked slow. Tolerances, from docs/memory.md's measurements:
the model states are closed forms and agree to the byte's rounding (1%); the tensors'
total agrees within 10% without recompute (tiny Llama -0.8%, full -11.2%, op -0.4%; the
8B: op +3.9%, full +5.8%), items compensating: the simulator sums each item's largest
value, the tracker takes one moment (the tiny model's backward temporaries and its
buffers are of the order of its activations, so the moment moves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from calibration.measured.fake_memory import tracked_peak
from calibration.measured.fake_memory_cli import comparison, fake_step, simulated
from simulator.cli.main import main
from simulator.model.transformer import param_count
from simulator.spec.load import load_scenario

TINY = """\
name: tiny-llama-fsdp2
stack: {preset: torchtitan, fusions: []}
model: {layers: 2, hidden: 256, heads: 4, kv_heads: 2, ffn_hidden: 768, vocab: 1024,
        seq_len: 256, activation: swiglu, norm: rmsnorm, bias: false, position: rope,
        tied_embeddings: false}
cluster: {system: dgx-h100, nodes: 1, gpus_per_node: 2}
parallel: {tp: 1, pp: 1, dp: 2, zero: 3, recompute: none}
training: {global_batch: 4, micro_batch: 2, dtype: bf16}
"""
STATES_TOL = 0.01  # closed forms: 4 B fp32 shard, 8 B AdamW moments per parameter / dp
TOTAL_TOL = 0.10  # the tensors' total, items compensating (module docstring)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fm") / "tiny.yaml"
    path.write_text(TINY)
    return path


def _rows(path: Path, *overrides: str) -> dict[str, dict[str, Any]]:
    s = load_scenario(path, list(overrides))
    return {r["item"]: r for r in comparison(simulated(s), tracked_peak(fake_step(s)))}


def test_tiny_llama_states_and_total_agree_with_the_tracker(tiny: Path) -> None:
    rows = _rows(tiny)
    params = param_count(load_scenario(tiny, []).model)
    assert rows["weights"]["tracker_step"] == pytest.approx(4 * params / 2, rel=STATES_TOL)
    for item in ("weights", "optimizer"):
        assert rows[item]["simulated"] == pytest.approx(rows[item]["tracker_step"],
                                                        rel=STATES_TOL)
    assert abs(rows["tensors"]["error"]) < TOTAL_TOL


def test_full_recompute_keeps_less_than_none(tiny: Path) -> None:
    """The tracker sees what checkpointing drops: one block input per layer kept."""
    none = _rows(tiny)["activations"]["tracker_fwd_bwd"]
    full = _rows(tiny, "parallel.recompute=full")["activations"]["tracker_fwd_bwd"]
    assert full < none / 2


@pytest.mark.parametrize("overrides, field", [
    (("parallel.tp=2", "parallel.dp=1"), "parallel.tp"),
    (("parallel.zero=1",), "parallel.zero"),
    (("model.activation=gelu",), "model.activation"),
    (("stack.preset=pytorch-eager",), "stack.master_weights"),
])
def test_refuses_what_the_model_cannot_express(tiny: Path, overrides: tuple[str, ...],
                                               field: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    sets = [arg for o in overrides for arg in ("--set", o)]
    assert main(["fake-memory", str(tiny), *sets]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and field in err


def test_cli_writes_json_and_table(tiny: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fake-memory", str(tiny), "--out", str(tmp_path)]) == 0
    assert "step 2 of 2" in capsys.readouterr().err  # progress
    assert (tmp_path / "memory.txt").read_text().startswith("tiny-llama-fsdp2")
    assert '"tensors"' in (tmp_path / "memory.json").read_text()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_llama3_8b_torchtitan_total_within_tolerance() -> None:
    path = Path(__file__).parent.parent / "scenarios" / "llama3-8b-8xh100-torchtitan.yaml"
    rows = _rows(path)
    assert rows["optimizer"]["simulated"] == pytest.approx(rows["optimizer"]["tracker_step"],
                                                           rel=STATES_TOL)
    assert abs(rows["tensors"]["error"]) < TOTAL_TOL
