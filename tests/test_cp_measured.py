"""The measured context-parallel run (calibration/measured/cp_worker.py): its loss and
gradients against the same model without CP (two gloo processes), its configuration
checks and the scenario it writes for `compare`."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from calibration.measured.measure_config import make_config
from calibration.measured.measure_launch import torchrun_command
from calibration.measured.measure_scenario import scenario_dict
from simulator.api import simulate_scenario
from simulator.spec.load import scenario_from_dict

torch = pytest.importorskip("torch")

TINY = {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _equivalence_rank(rank: int, port: int, cp: int, queue: Any) -> None:
    import torch.distributed as dist

    from calibration.measured.cp_worker import equivalence
    from calibration.measured.gpt import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=cp)
    try:
        queue.put((rank, equivalence(GPTConfig(**TINY), batch=2)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2])
def test_cp_loss_and_gradients_equal_the_model_without_cp(cp: int) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")  # torch is already imported: no re-import per rank
    queue = ctx.Queue()
    mp.start_processes(_equivalence_rank, args=(_free_port(), cp, queue), nprocs=cp,
                       start_method="fork")
    results = dict(queue.get(timeout=5) for _ in range(cp))
    for diffs in results.values():
        assert diffs["loss"] < 1e-5
        assert diffs["grad"] < 1e-5 * diffs["grad_scale"]


def test_chunks_balance_the_causal_work() -> None:
    from calibration.measured.cp_worker import chunk_positions

    seq, cp = 32, 4
    held = [chunk_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))  # a partition
    work = {int((pos + 1).sum()) for pos in held}  # keys each query attends to
    assert len(work) == 1  # the same on every rank
    assert held[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    with pytest.raises(ValueError, match="not divisible by 2·cp=8"):
        chunk_positions(20, 4, 0)


def test_configuration_checks(tmp_path: Path) -> None:
    cfg = make_config(tp=1, pp=1, dp=1, cp=2, model="tiny-gpt", out_dir=tmp_path)
    assert cfg.world_size == 2
    assert "calibration.measured.cp_worker" in torchrun_command(cfg, Path("c.json"))
    for kwargs, text in [({"tp": 2}, "use tp 1, pp 1"),
                         ({"experts": 4, "dp": 2}, "use tp 1, pp 1"),
                         ({"cp": 3}, "model.seq_len=64: not divisible by 2·cp=6")]:
        args: dict[str, Any] = {"tp": 1, "pp": 1, "dp": 1, "cp": 2, "model": "tiny-gpt",
                                **kwargs}
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            make_config(**args)


def test_scenario_of_a_cp_run_is_simulated_with_the_kv_all_gather(tmp_path: Path) -> None:
    cfg = make_config(tp=1, pp=1, dp=1, cp=2, model="tiny-gpt", out_dir=tmp_path)
    d = scenario_dict(cfg)
    s = scenario_from_dict(json.loads(json.dumps(d)))
    assert (s.parallel.cp, s.parallel.cp_comm_type, s.training.global_batch) == (
        2, "allgather", cfg.micro_batches * cfg.micro_batch_size)
    results, _ = simulate_scenario(s, "engine", "full")
    layers, mb = cfg.model["layers"], cfg.micro_batches
    # forward only, per rank: the worker's GatherKV keeps the gathered K/V for the backward
    # (pytorch-eager's cp_kv_backward: saved), as its profiler trace shows (16 gloo
    # all_gathers and 16 reduce-scatters per rank and step of tiny-gpt, 4 micro-batches)
    assert s.cp_keeps_gathered_kv
    assert results["collectives"]["cp.all_gather"]["count"] == 2 * layers * mb  # ranks·fwd
    assert results["collectives"]["cp.reduce_scatter"]["count"] == 2 * layers * mb


@pytest.mark.slow
def test_measured_cp_run_and_its_comparison(tmp_path: Path) -> None:
    """A real two-process run (gloo): it trains, and its state bytes are the memory
    model's exactly."""
    from calibration.measured.compare import run_compare
    from calibration.measured.measure import run_measure

    measured = run_measure(1, 1, 1, cp=2, model="tiny-gpt", steps=2, warmup=1,
                           out_dir=str(tmp_path), timeout_s=300)
    assert measured["step_time_s"] > 0 and measured["cp"] == 2 and measured["world_size"] == 2
    comparison = run_compare(tmp_path, "cpu-1thread", plot=False)
    assert comparison["relative_error"]["state_bytes"] == pytest.approx(0.0, abs=1e-9)
