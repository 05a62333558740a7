"""Memory as the device sees it (simulator/model/device_memory.py), each term against the
source line it comes from, and the cross-check with Megatron-LM's theoretical memory."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.memory import memory_items, stage_breakdown
from simulator.model import device_memory as dm
from simulator.model.memory import activation_bytes_per_layer, in_flight_microbatches
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.spec.stack import preset_stack_names
from simulator.system.hardware import NO_RUNTIME, RuntimeMemory

MiB = 1 << 20


def scenario(system: str = "dgx-h100", nodes: int = 2, stack: Any = "megatron-core",
             model: Any = "llama3-8b", training: dict[str, Any] | None = None,
             gpus_per_node: int = 8, **parallel: Any) -> Scenario:
    return scenario_from_dict({
        "name": "test", "stack": stack, "model": {"preset": model},
        "cluster": {"system": system, "nodes": nodes, "gpus_per_node": gpus_per_node},
        "parallel": parallel,
        "training": training or {"global_batch": 64, "micro_batch": 1},
    })


# ---------------------------------------------------------------- NCCL


def test_nccl_buffer_sizes_are_the_2_20_defaults() -> None:
    # src/include/device.h: NCCL_LL_LINES_PER_THREAD 8, NCCL_LL_MAX_NTHREADS 512,
    # NCCL_STEPS 8, a 16-byte ncclLLFifoLine; NCCL_LL128_ELEMS_PER_THREAD 120,
    # NCCL_LL128_MAX_NTHREADS 640, 8-byte elements; src/init.cc DEFAULT_BUFFSIZE 1 << 22
    assert dm.LL_BUFFSIZE == 512 * 1024
    assert dm.LL128_BUFFSIZE == 4_915_200
    assert dm.SIMPLE_BUFFSIZE == 4 << 20
    # a receiver's 10 MiB and a sender's 2 MiB: the two sizes NCCL_DEBUG_SUBSYS=ALLOC
    # prints on H100 (NVIDIA/nccl#1685: 10485760 and 2097152)
    assert dm.nccl_connection_bytes() == 10_485_760 + 2_097_152


@pytest.mark.parametrize(("channels", "ranks", "remote", "per_peer"), [
    (16, 8, False, 16),   # NVLink peers: the communicator's p2p channels
    (24, 8, False, 32),   # rounded up to a power of two
    (16, 2, True, 2),     # a network peer: 2 per NIC
    (16, 16, True, 2),    # 2 · 16 = 32 <= 4 · 16
    (16, 64, True, 1),    # 2 · 64 > 64: halved (DeepSeek-V3's EP 64)
    (4, 64, True, 1),
])
def test_p2p_channels_per_peer(channels: int, ranks: int, remote: bool, per_peer: int) -> None:
    assert dm.p2p_channels_per_peer(channels, ranks, remote) == per_peer


def test_nccl_buffers_per_communicator() -> None:
    # TP 8 in a node and DP 2 across two: two rings of 16 channels; PP 1: no pipeline peers
    s = scenario(tp=8, dp=2)
    assert [c.name for c in dm.communicators(s, 0)] == ["tp", "dp"]
    assert dm.nccl_buffers(s, 0) == 2 * 16 * 12 * MiB
    # a pipeline of 2 across nodes: one neighbour, 2 network channels
    s = scenario(tp=8, pp=2)
    assert dm.nccl_buffers(s, 1) == 16 * 12 * MiB + 1 * 2 * 12 * MiB
    # the interleaved schedule wraps around: the first stage has two neighbours
    s = scenario(tp=4, pp=4, schedule="interleaved", virtual_stages=2, nodes=2,
                 training={"global_batch": 64, "micro_batch": 1})
    assert [c.peers for c in dm.communicators(s, 0) if c.name == "pp"] == [2]


def test_a_cpu_profile_has_no_runtime_memory() -> None:
    s = scenario(system="cpu-1thread", nodes=1, gpus_per_node=2, stack="pytorch-eager",
                 model="tiny-gpt", dp=2)
    assert stage_breakdown(s, 0).runtime == 0


# ---------------------------------------------------------------- the allocator


@pytest.mark.parametrize(("n", "block", "segment", "stranded"), [
    (1, 512, 2 * MiB, 511),                       # kMinBlockSize; a small segment, split
    (513, 1024, 2 * MiB, 511),
    (MiB, MiB, 2 * MiB, 0),                       # kSmallSize: still the small pool
    (MiB + 1, MiB + 512, 20 * MiB, 511),          # kLargeBuffer, its rest split off
    (10 * MiB, 10 * MiB, 10 * MiB, 0),            # kMinLargeAlloc: exactly a segment
    (11 * MiB + 1, 11 * MiB + 512, 12 * MiB, MiB - 1),  # kRoundLarge; tail <= 1 MiB kept
    (21 * MiB // 2, 21 * MiB // 2, 12 * MiB, 0),  # 1.5 MiB left: split off, reusable
])
def test_caching_allocator_rounding(n: int, block: int, segment: int, stranded: int) -> None:
    assert dm.block_bytes(n) == block
    assert dm.segment_bytes(n) == segment
    assert dm.stranded_bytes(n) == stranded


# ---------------------------------------------------------------- memory and the inventory


@settings(max_examples=25, deadline=None)
@given(stack=st.sampled_from(preset_stack_names()),
       recompute=st.sampled_from(["none", "selective", "full"]),
       tp=st.sampled_from([1, 2, 4]), sp=st.booleans(), b=st.sampled_from([1, 2]))
def test_the_allocators_tensors_are_what_memory_keeps(stack: str, recompute: str, tp: int,
                                                     sp: bool, b: int) -> None:
    """The tensors the allocator term rounds are, together, what memory counts as a
    layer's activations, for every stack: memory and the op inventory agree."""
    s = scenario(stack=stack, tp=tp, recompute=recompute, sequence_parallel=sp and tp > 1,
                 nodes=1, gpus_per_node=tp, model="tiny-gpt",
                 training={"global_batch": 64, "micro_batch": b})
    for layer in (0, s.model.layers - 1):
        kept = activation_bytes_per_layer(s.model, b, tp, s.parallel.sequence_parallel,
                                          recompute, s.training.dtype, layer, stack=s.stack)
        assert sum(dm._kept_tensors(s, layer)) == pytest.approx(kept)


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b"])
def test_memory_items_add_up_to_the_total(model: str) -> None:
    s = scenario(model=model, tp=2, pp=2, dp=4)
    m = stage_breakdown(s, 0)
    items = memory_items(m)
    assert sum(nbytes for _, nbytes, _ in items) == pytest.approx(m.total)
    assert all(source for _, _, source in items)  # every item names where it comes from
    assert [name for name, _, _ in items][-4:] == [t.name for t in dm.DEVICE_TERMS]


# ---------------------------------------------------------------- Megatron's own estimate


def test_distributed_optimizer_matches_megatrons_theoretical_memory() -> None:
    # megatron/training/theoretical_memory_usage.py, compute_weight_and_optimizer_memory:
    # 6 + 12 / data_parallel_size bytes per parameter with --use-distributed-optimizer
    # (bf16 weights, fp32 main grads, fp32 master weights and moments sharded)
    dp = 8
    s = scenario(stack="megatron-core", tp=2, dp=dp, zero=1, nodes=2)
    m = stage_breakdown(s, 0)
    psi = m.weights / 2
    assert (m.weights + m.gradients + m.optimizer) / psi == pytest.approx(6 + 12 / dp)


@pytest.mark.parametrize(("p", "v"), [(4, 2), (8, 4), (16, 8)])
def test_interleaved_in_flight_matches_megatrons_penalty(p: int, v: int) -> None:
    # theoretical_memory_usage.py: the first stage holds p micro-batches' activations
    # times 1 + (p - 1) / (p v) under the interleaved schedule; Megatron-Core's warm-up
    # (schedules.py get_pp_rank_microbatches: 2 (p - r - 1) + (v - 1) · group, the group
    # being p by default) plus the one forward of the steady state gives the same with
    # enough micro-batches
    m = 4 * p
    assert in_flight_microbatches("interleaved", p, m, v, 0) == pytest.approx(
        p * (1 + (p - 1) / (p * v)))


def test_a_profile_without_runtime_gets_a_gpus_defaults_and_a_cpu_none() -> None:
    """Profiles calibrated before ``gpu.runtime``: a CUDA GPU's defaults (H100's), and
    nothing for a CPU device (``host_serial``: gloo, no CUDA)."""
    gpu = scenario(tp=8, dp=2).hardware.gpu.model_copy(update={"runtime": None})
    assert gpu.runtime_memory() == RuntimeMemory()
    assert gpu.model_copy(update={"host_serial": True}).runtime_memory() == NO_RUNTIME
    assert NO_RUNTIME.context_GB == NO_RUNTIME.nccl_channels == 0


def test_cli_memory_lists_every_item_with_its_source(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from simulator.cli.main import main

    path = Path(__file__).parent.parent / "scenarios" / "llama3-405b-16k-h100.yaml"
    assert main(["memory", str(path)]) == 3  # 88.5 GB of 80: the verdict's exit status
    out = capsys.readouterr().out
    header, _, items = out.partition("item by item:")
    assert "device" in header.splitlines()[1] and items
    lines = [ln for ln in items.strip().splitlines() if not ln.startswith("memory:")]
    assert len(lines) == 6 + len(dm.DEVICE_TERMS)
    for term in dm.DEVICE_TERMS:
        assert any(line.split("GB  ")[-1] == term.source for line in lines
                   if line.strip().startswith(term.name))
    # TP and DP rings (16 channels) and two pipeline peers on 2 network channels each
    assert "NCCL buffers             0.45 GB" in items
