"""Memory as the device sees it: what a training process holds besides its tensors.

The tensors (:mod:`simulator.model.memory`, :mod:`simulator.analysis.memory`) are what
``torch.cuda.max_memory_allocated`` counts; the GPU also holds, per process:

- **the CUDA context**: the driver's state and the kernels it has loaded. Since CUDA
  11.7 with lazy module loading (PyTorch's default, pytorch/pytorch#86509: 287 MB
  measured against 667 MB eager) about 400 MB (pytorch/pytorch#109888, "around 400MB
  if CUDA >= 11.7 is used and lazy module loading enabled"); a per-GPU constant of the
  system (``gpu.runtime.context_GB``), overridable.
- **cuBLAS workspaces**: one per handle and stream that runs GEMMs, of PyTorch's
  default size (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``getChosenWorkspaceSize``:
  ``:4096:8`` = 32 MiB on Hopper and Blackwell, ``:4096:2:16:8`` = 8.125 MiB before);
  ``gpu.runtime.cublas_workspace_MiB`` times ``gpu.runtime.gemm_streams``.
- **NCCL's buffers**, per communicator the rank belongs to (NCCL 2.20.3, commit
  b6475625): each connection's receiver holds the LL, LL128 and Simple FIFOs
  (``src/transport/p2p.cc``, ``p2pRecvSetup``), ``DEFAULT_LL_BUFFSIZE`` = 8 lines × 512
  threads × 8 steps × 16 B = 512 KiB, ``DEFAULT_LL128_BUFFSIZE`` = 120 × 640 × 8 × 8 B =
  4.6875 MiB, ``DEFAULT_BUFFSIZE`` = 4 MiB (``src/init.cc``; ``src/include/device.h``),
  behind a 4 KiB header and rounded up to ``CUDA_IPC_MIN`` = 2 MiB
  (``src/include/comm.h``): 10 MiB; the sender a 2 MiB header block (with P2P read
  the Simple FIFO moves to the sender: 6 + 6 MiB, the same 12 MiB). NVIDIA/nccl#1685
  sees exactly these two sizes, 10,485,760 and 2,097,152 bytes, on H100. A ring
  collective's rank has one connection in and one out per channel (NVIDIA/nccl#986:
  a ring "only has 2 connections regardless of the scale"): channels × 12 MiB. A
  point-to-point communicator (pipeline sends, the experts' all-to-all) connects to
  each peer it exchanges with on NCCL's channels per peer (``src/graph/paths.cc``,
  ``ncclTopoGetNchannels``, ``ncclTopoComputeP2pChannels``): the communicator's p2p
  channels over NVLink, over the network 2 per NIC, halved while 2 · ranks > 4 ·
  p2p channels, the minimum over peers rounded to a power of two. Channels come from
  NCCL's topology search; ``gpu.runtime.nccl_channels`` is what its logs print on
  the system (16 on DGX H100 and HGX H800: NVIDIA/nccl#1453, #892). Not modelled:
  tree and NVLS connections (NVLS buffers grow with ``NCCL_NVLS_CHUNKSIZE``; the
  all-reduces of these strategies run as rings in :mod:`simulator.system.nccl`'s
  default), network FIFOs in host memory (counted here as if on the GPU: an upper
  bound), PyTorch's per-pair send/recv communicators beside the group's.
- **the caching allocator's rounding** (``c10/cuda/CUDACachingAllocator.cpp``): a
  request rounds up to ``kMinBlockSize`` = 512 B; a new segment is ``kSmallBuffer``
  = 2 MiB for requests up to ``kSmallSize`` = 1 MiB, ``kLargeBuffer`` = 20 MiB below
  ``kMinLargeAlloc`` = 10 MiB, else the request rounded to ``kRoundLarge`` = 2 MiB;
  a large block is split only when more than ``kSmallSize`` remains
  (``should_split``), so up to 1 MiB of each large segment stays with its block.
  Counted over the tensors the stage keeps for backward, each forward op's saved bytes
  one allocation. Fragmentation from activations freed out of order is not a closed
  form: the planner's headroom (:mod:`simulator.search.plan`) stands for it.

Each term is one entry of :data:`DEVICE_TERMS` (a name, where it comes from, and its
bytes on one GPU of a stage), so another term is one more entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from simulator.model import moe
from simulator.model.inventory.layer import latent_kept, saved_tensors
from simulator.model.transformer import RecomputeMode
from simulator.schedules.registry import schedule_spec
from simulator.spec.model_spec import ModelSpec
from simulator.spec.recompute import kept_runs, layer_mode, stage_modes
from simulator.spec.scenario import Scenario
from simulator.spec.stack import StackSpec

MiB = 1 << 20

# NCCL 2.20.3 (NVIDIA/nccl b6475625), src/include/device.h and src/init.cc
NCCL_STEPS = 8
LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16  # LL lines/thread × LL threads × steps × 16 B line
LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8  # LL128 elems/thread × threads × steps × 8 B
SIMPLE_BUFFSIZE = 1 << 22  # DEFAULT_BUFFSIZE, 4 MiB (NCCL_BUFFSIZE)
CONN_HEADER = 4096  # ncclRecvMem / ncclSendMem: one MEM_ALIGN page before the FIFOs
CUDA_IPC_MIN = 2 * MiB  # src/include/comm.h: the granularity of a connection's buffer

# PyTorch c10/cuda/CUDACachingAllocator.cpp
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_LARGE_BUFFER = 20 * MiB
K_ROUND_LARGE = 2 * MiB


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def nccl_connection_bytes() -> int:
    """One connection's buffers, receiver and sender together (12 MiB at the defaults)."""
    recv = _align(CONN_HEADER + LL_BUFFSIZE + LL128_BUFFSIZE + SIMPLE_BUFFSIZE, CUDA_IPC_MIN)
    return recv + _align(CONN_HEADER, CUDA_IPC_MIN)


def p2p_channels_per_peer(channels: int, ranks: int, remote: bool) -> int:
    """NCCL's channels per peer of a point-to-point communicator of ``ranks`` ranks
    (paths.cc): its p2p channels (``channels`` rounded to a power of two) when every
    peer is on NVLink, else 2 per NIC, halved while 2 · ranks > 4 · p2p channels."""
    p2p = _pow2(channels)
    if not remote:
        return p2p
    per_peer = 2
    while per_peer * ranks > p2p * 4 and per_peer > 1:
        per_peer //= 2
    return _pow2(min(per_peer, p2p))


def _pow2(n: int) -> int:
    out = 1
    while out < n:
        out <<= 1
    return out


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank belongs to: ``ring`` (collectives: one connection
    pair per channel) or ``p2p`` (``peers`` peers it exchanges with)."""

    name: str
    ranks: int
    stride: int  # rank distance between neighbours (the layout's order)
    kind: str  # "ring" or "p2p"
    peers: int = 0


def communicators(s: Scenario, stage: int) -> list[Communicator]:
    """The communicators one rank of ``stage`` uses, in Megatron's group order: TP, CP,
    the data-parallel group with CP (under hybrid sharding its shard group and its
    replicate group instead), the pipeline's neighbours, the experts' all-to-all, expert
    TP and expert data parallelism (groups of one rank have none)."""
    par = s.parallel
    out = [Communicator("tp", par.tp, 1, "ring"), Communicator("cp", par.cp, par.tp, "ring"),
           Communicator("dp", par.shard if par.zero == 3 else par.dp * par.cp, par.tp, "ring")]
    if par.zero == 3 and par.shard < par.dp * par.cp:
        out.append(Communicator("replicate", par.dp * par.cp // par.shard, par.tp * par.shard,
                                "ring"))
    if par.pp > 1:  # the interleaved schedule wraps from the last stage to the first
        wraps = schedule_spec(par.schedule).chunked and par.virtual_stages > 1
        neighbours = 2 if wraps or 0 < stage < par.pp - 1 else 1
        out.append(Communicator("pp", par.pp, par.tp * par.cp * par.dp, "p2p", neighbours))
    if s.model.is_moe:
        out += _dispatcher_communicators(s)
        out.append(Communicator("edp", max(par.edp, 1), par.etp * par.ep, "ring"))
    return [c for c in out if c.ranks > 1]


def _dispatcher_communicators(s: Scenario) -> list[Communicator]:
    """The communicators the token dispatcher runs NCCL on (NCCL connects a peer at its
    first transfer, so a group no collective uses holds no buffers): alltoall, the EP
    all-to-all's peers and the expert-TP ring; allgather, one ring over expert-TP × EP;
    flex, none (DeepEP's own buffers are the expert strategy's memory term)."""
    par = s.parallel
    return {"alltoall": [Communicator("ep", par.ep, par.etp, "p2p", par.ep - 1),
                         Communicator("etp", par.etp, 1, "ring")],
            "allgather": [Communicator("tp_ep", par.etp * par.ep, 1, "ring")],
            "flex": []}[par.moe_token_dispatcher]


def communicator_bytes(c: Communicator, channels: int, gpus_per_node: int) -> float:
    """NCCL's buffers one rank holds for communicator ``c``."""
    if c.kind == "ring":
        return float(channels * nccl_connection_bytes())
    remote = c.stride * c.ranks > gpus_per_node  # the group leaves its node
    return float(c.peers * p2p_channels_per_peer(channels, c.ranks, remote)
                 * nccl_connection_bytes())


# ---------------------------------------------------------------- the allocator


def block_bytes(n: float) -> int:
    """The caching allocator's block for a request of ``n`` bytes (``round_size``)."""
    return max(K_MIN_BLOCK, _align(int(n), K_MIN_BLOCK))


def segment_bytes(n: float) -> int:
    """The segment a request of ``n`` bytes opens when no cached block fits
    (``get_allocation_size`` of its block)."""
    size = block_bytes(n)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return _align(size, K_ROUND_LARGE)


def stranded_bytes(n: float) -> int:
    """Bytes reserved but not allocated for a tensor of ``n`` bytes in its own segment:
    the 512-byte rounding, and the segment's tail where ``should_split`` keeps it with
    the block (a large block splits only when more than ``kSmallSize`` remains; a small
    one whenever 512 bytes do)."""
    block = block_bytes(n)
    tail = segment_bytes(n) - block
    if block <= K_SMALL_SIZE or tail > K_SMALL_SIZE:
        tail = 0
    return block - int(n) + tail


def _kept_tensors(s: Scenario, layer: int) -> tuple[float, ...]:
    """The tensors one layer of ``s`` keeps for backward on one rank
    (:func:`~simulator.model.inventory.layer.saved_tensors`; a latent-attention layer's
    coarser ops keep what each saves, whatever the recomputation short of full)."""
    par, trn = s.parallel, s.training
    return _layer_kept(s.model, trn.micro_batch, par.tp, par.sequence_parallel, trn.dtype,
                       layer_mode(par, s.model.layers, layer), s.stack, par.cp, layer)


@functools.lru_cache(maxsize=4096)
def _layer_kept(spec: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                dtype: str, recompute: RecomputeMode, st: StackSpec, cp: int,
                layer: int) -> tuple[float, ...]:
    """:func:`_kept_tensors` of the layer knobs it reads (a plan's candidates share a few
    hundred layers: cached)."""
    if cp > 1:
        spec = spec.model_copy(update={"seq_len": spec.seq_len // cp})
    if spec.mla is not None and recompute != "full":
        return latent_kept(spec, micro_batch, tp, sequence_parallel, dtype, recompute, st,
                           layer)
    return saved_tensors(spec, micro_batch, tp, sequence_parallel, dtype, recompute, st,
                         spec.is_moe_layer(layer))


@functools.lru_cache(maxsize=1024)
def _stranded(tensors: tuple[float, ...]) -> float:
    """What the rounding strands over one layer's kept ``tensors`` (the same layers recur
    stage after stage and candidate after candidate in a plan: cached)."""
    return sum(stranded_bytes(t) for t in tensors)


def allocator_rounding(s: Scenario, stage: int) -> float:
    """What the allocator's rounding strands over the tensors ``stage`` keeps for
    backward: per layer and in-flight micro-batch, each saved tensor's
    :func:`stranded_bytes`."""
    par = s.parallel
    in_flight = schedule_spec(par.schedule).in_flight(par.pp, s.microbatches,
                                                      par.virtual_stages, stage)
    per_pass = 0.0
    # one group unless partial
    for _, chunks in stage_modes(par, s.model.layers, stage, s.model.mtp_layers):
        kinds = [kind for r in kept_runs(par, chunks) for kind in moe.run_kinds(s.model, r)]
        per_pass += sum(n * _stranded(_kept_tensors(s, i)) for i, n in kinds)
    return per_pass * in_flight


# ---------------------------------------------------------------- the terms


def cuda_context(s: Scenario, stage: int) -> float:
    return s.hardware_of_stage(stage).gpu.runtime_memory().context_GB * 1e9


def cublas_workspaces(s: Scenario, stage: int) -> float:
    rt = s.hardware_of_stage(stage).gpu.runtime_memory()
    return rt.cublas_workspace_MiB * MiB * rt.gemm_streams


def nccl_buffers(s: Scenario, stage: int) -> float:
    channels = s.hardware_of_stage(stage).gpu.runtime_memory().nccl_channels
    per_node = s.cluster.gpus_per_node or 1
    return sum(communicator_bytes(c, channels, per_node) for c in communicators(s, stage))


@dataclass(frozen=True)
class DeviceTerm:
    """A named term of device memory: where it comes from and its bytes on one GPU."""

    name: str
    source: str
    bytes: Callable[[Scenario, int], float]


#: the device terms, in the order ``clustersim memory`` lists them
DEVICE_TERMS: tuple[DeviceTerm, ...] = (
    DeviceTerm("cuda context", "gpu.runtime.context_GB (pytorch/pytorch#109888, lazy loading)",
               cuda_context),
    DeviceTerm("cuBLAS workspaces", "PyTorch CublasHandlePool.cpp getChosenWorkspaceSize "
               "× gpu.runtime.gemm_streams", cublas_workspaces),
    DeviceTerm("NCCL buffers", "NCCL 2.20.3 init.cc/p2p.cc: 12 MiB per connection × channels "
               "(ring) or peers × channels per peer (p2p)", nccl_buffers),
    DeviceTerm("allocator rounding", "c10/cuda/CUDACachingAllocator.cpp round_size, "
               "get_allocation_size, should_split", allocator_rounding),
)


def device_terms(s: Scenario, stage: int) -> dict[str, float]:
    """Each device term's bytes on one GPU of ``stage``, by name."""
    return {term.name: term.bytes(s, stage) for term in DEVICE_TERMS}
