"""The SMs an NCCL collective's kernel holds while it runs, and what that costs the
compute beside it.

NCCL runs a collective as one kernel of one thread block per channel, and each block
stays resident on its SM until the collective is done, so a compute kernel overlapped
with it gets the GPU's other SMs. Sources (NVIDIA/nccl, re-expressed here, never
copied; tag v2.18.1-1, this simulator's default NCCL version, and the same rule in
v2.20.3-1 and v2.23.4-1):

- ``src/enqueue.cc`` ``ncclLaunchKernel``: the grid is ``{plan->channelCount, 1, 1}``,
  one CTA per channel the plan's work uses (``finishPlan`` counts them);
- ``src/enqueue.cc`` ``getAlgoInfo`` (``topoGetAlgoInfo`` from 2.19): the channels a
  collective uses start from the communicator's (``comm->nChannels``, which NCCL's
  INIT log prints: ``gpu.runtime.nccl_channels``); NVLS and NVLS-tree take
  ``comm->nvlsChannels`` (``NCCL_NVLS_NCHANNELS``, 16: ``src/transport/nvls.cc``);
  ring and tree drop one channel while ``nBytes < nc · nt · threadThreshold``, down to
  one (then halve the threads, which leaves the SMs held);
- ``src/graph/tuning.cc`` ``ncclTopoTuneModel``: ``nt`` is ``maxThreads`` (LL and Simple
  512, LL128 640: ``src/include/devcomm.h``; a ring/Simple on a PCIe-only system 256,
  not modelled: every profile with ``gpu.sms`` is an NVLink system) and
  ``threadThreshold`` LL 8 (× nRanks for the ring), LL128 8, Simple 64
  (``src/include/comm.h``);
- ``src/include/info.h`` ``ncclInfoSetDerived``: ``nBytes`` is the whole buffer for
  all-gather and reduce-scatter (the per-rank count × nRanks), as ``Plan.size``.

So a ring/Simple collective of 512 KiB or more holds 16 channels on a 16-channel
communicator. NCCL's point-to-point (all-to-all, send/recv) schedules its channels
per peer and is not modelled here (its plans hold none). The slowdown of the compute
beside it, gpu.sms / (gpu.sms − held), assumes the compute spreads over the SMs it
gets (no wave quantisation of one GEMM's tiles).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.system.collectives.plan import Plan
from simulator.system.hardware import GPUSpec, HardwareProfile

NVLS_CHANNELS = 16  # NCCL_NVLS_NCHANNELS' default (src/transport/nvls.cc)
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}  # NCCL_*_MAX_NTHREADS
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}  # NCCL_*_THREAD_THRESHOLD
NCCL_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast"})
NCCL_RUN = frozenset({"ring", "tree", "nvls", "nvls_tree", "pat"})  # NCCL's kernels


def channels(algorithm: str, protocol: str, n: int, size: float, nchannels: int) -> int:
    """The channels (thread blocks, so SMs) NCCL runs a collective of ``size`` bytes over
    ``n`` ranks with, on a communicator of ``nchannels`` (0: none, no NCCL)."""
    if nchannels <= 0 or n <= 1 or size <= 0:
        return 0
    if algorithm in ("nvls", "nvls_tree"):
        return min(NVLS_CHANNELS, nchannels)
    threshold = THREAD_THRESHOLD[protocol] * (n if algorithm == "ring" and protocol == "LL"
                                              else 1)
    # the loop ``while (nBytes < nc*nt*threshold && nc >= 2) nc--``, in closed form
    return max(1, min(nchannels, int(size) // (MAX_THREADS[protocol] * threshold)))


def with_channels(plan: Plan, hw: HardwareProfile) -> Plan:
    """``plan`` with the SMs its NCCL kernel holds (``Plan.sms``); other libraries' plans
    and NCCL's point-to-point unchanged."""
    if plan.algorithm not in NCCL_RUN or plan.op not in NCCL_OPS or plan.sms:
        return plan
    held = channels(plan.algorithm, plan.protocol, plan.n, plan.size,
                    hw.gpu.runtime_memory().nccl_channels)
    return replace(plan, sms=held) if held else plan


def sm_factor(plan: Plan, gpu: GPUSpec) -> float:
    """How many times slower compute runs while ``plan``'s kernels hold their SMs:
    gpu.sms / (gpu.sms − held); 1 where transfers run in line with compute, where the
    GPU's SMs are not stated, and for an NCCL plan on a profile with a calibrated
    ``gpu.interference`` (measured beside NCCL's kernels, so it already holds this:
    the measurement wins, never both)."""
    if not plan.sms or not gpu.sms or not gpu.comm_overlaps_compute:
        return 1.0
    if gpu.interference and plan.algorithm in NCCL_RUN:
        return 1.0
    return gpu.sms / max(gpu.sms - plan.sms, 1)
