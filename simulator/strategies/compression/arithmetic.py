"""Gradient compression: what each method puts on the wire, computes and keeps in memory.

Pure arithmetic over a :class:`~simulator.spec.scenario.Scenario`; the data pass
(:mod:`simulator.strategies.compression.workload`) turns it into tasks, the analytic method
into closed forms, :mod:`simulator.model.memory` into bytes. The scenario describes one
step: ``gradient_compression.step`` (default: a step after the warm-up, the steady
state) says whether that step is compressed (:func:`compressed_step`); a step
before the warm-up ends is the same scenario with ``method: none``.

**PowerSGD** (Vogels et al. 2019) as PyTorch's DDP communication hook runs it
(``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``,
``powerSGD_hook``): per gradient bucket, each tensor is viewed as an n×m matrix
(``tensor.view(shape[0], -1)``); it is compressed when (n + m)·r ·
``min_compression_rate`` < n·m (``_should_compress``, r = min(n, m, rank)), so
biases and norm weights (n×1) never are. The bucket first adds its error-feedback
buffer and keeps a copy, orthogonalises the warm-started Qs and computes P = M·Q;
then all-reduces the uncompressed tensors as one batch, then all Ps (Σ n·r), then
orthogonalises P and computes Q = Mᵀ·P, all-reduces all Qs (Σ m·r), and
decompresses M = P·Qᵀ and stores the new error (copy − M). Three all-reduces per
bucket, one after the other. The hook works in the bucket's dtype, taken here as
fp32 (DDP with autocast keeps fp32 gradients; ``torch.linalg.qr``, which the hook
uses for r > 2, has no 16-bit kernels): P, Q, the uncompressed tensors and the
error buffer are 4 bytes per element. Memory: the error buffer (every gradient
element), P and Q, and the copy of the (two in flight) buckets.
``start_step`` is ``start_powerSGD_iter``: vanilla all-reduce before it.

**1-bit Adam** (Tang et al. 2021) as DeepSpeed implements it
(``deepspeed/runtime/fp16/onebit/adam.py``, ``deepspeed/runtime/comm/nccl.py``
``NcclBackend.compressed_allreduce``): for ``freeze_step`` steps the engine
all-reduces gradients as usual (the warm-up); then it stops
(``enable_backward_allreduce = False``) and the optimizer step updates the
momentum locally and exchanges it compressed. The worker adds its error
buffer, takes one scale (‖m‖/√N), keeps the new error and packs the signs into
bits, one chunk per rank; phase 1 is an ``all_to_all_single`` of the packed signs
(N/8 bytes) and an ``all_gather`` of the scales; each rank as a server unpacks
its chunk from every worker, averages, adds its server error, re-compresses its
chunk (one scale per chunk); phase 2 is an ``all_gather`` of the packed chunks
(N/8 bytes) and one of the scales, and every rank unpacks the whole momentum.
That is 2(n−1)/n · N/8 bytes per rank: 1/32 of an fp32 all-reduce, 1/16 of a
16-bit one. Memory: the worker error (N fp32) and the server error (N/n fp32),
which DeepSpeed allocates at the first step (so also during the warm-up). The
compression kernels are counted pass by pass from that code (elementwise torch
ops and cupy ``packbits``/``unpackbits``), as bandwidth-bound passes.

**bf16 / fp8**: gradients cast to 2 / 1 bytes before the reduction and back after
it (PyTorch's ``bf16_compress_hook`` does the cast in the hook; fp8 is a wire
format, e.g. MS-AMP's fp8 gradient all-reduce, with a scale read first); every
data-parallel gradient reduction carries the smaller elements, the parameter
all-gather of ZeRO does not. A wire no smaller than the training dtype is a no-op.

The hook's and the exchange's compute is bandwidth-bound passes and small GEMMs
priced by the same cost model as every kernel (fp32), and counted as the
``optimizer`` accounting category (it is part of producing the update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from simulator.model.inventory.ops import Op, dtype_bytes
from simulator.spec import placement
from simulator.system.costs import CostModel
from simulator.system.units import CollectiveName

if TYPE_CHECKING:
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.scenario import GradientCompressionSpec, Scenario

POWERSGD_RANK = 4  # our default; PyTorch's PowerSGDState default is 1
POWERSGD_MIN_COMPRESSION_RATE = 2.0  # PowerSGDState default
POWERSGD_START_STEP = 1000  # PowerSGDState start_powerSGD_iter default
ONEBIT_FREEZE_STEP = 100_000  # OnebitAdam freeze_step default
HOOK_BYTES = 4  # the PowerSGD hook's and OnebitAdam's buffers are fp32
WIRE_BYTES = {"bf16": 2, "fp8": 1}
FIELDS = {"rank": "powersgd", "min_compression_rate": "powersgd", "start_step": "powersgd",
           "freeze_step": "onebit_adam"}

# 1-bit Adam's kernels, bytes moved per element (fp32 = 4, bool/uint8 = 1, bits = 1/8),
# read off NcclBackend.compressed_allreduce: x.add_(err) 12; norm 4; the error
# x - scale·(x.sign().add_(1).bool().float().add_(-0.5).mul_(2)): sign 8, add 8, bool 5,
# float 5, add 8, mul 8, scale 8, subtract 12 = 62; packing x.sign_().add_(1).bool() to
# uint8 and packbits: 8 + 8 + 5 + 2 + 1.125 = 24.125.
_COMPRESS_BYTES = 12 + 4 + 62 + 24.125
# unpackbits, float, add, mul, mul by the scales (1.125 + 5 + 8 + 8 + 8), the sum over
# the n workers' chunks (read 4, write 4/n: added in :func:`onebit_ops`)
_UNPACK_BYTES = 30.125 + 4
_FINAL_COPY_BYTES = 8  # buffer_m.data.copy_(unpacked)


def spec_of(s: Scenario) -> GradientCompressionSpec:
    return s.training.gradient_compression


def rank_of(g: GradientCompressionSpec) -> int:
    return g.rank if g.rank is not None else POWERSGD_RANK


def warmup_steps(g: GradientCompressionSpec) -> int:
    """Steps that run uncompressed before compression starts."""
    if g.method == "powersgd":
        return g.start_step if g.start_step is not None else POWERSGD_START_STEP
    if g.method == "onebit_adam":
        return g.freeze_step if g.freeze_step is not None else ONEBIT_FREEZE_STEP
    return 0


def compressed_step(s: Scenario) -> bool:
    """Whether the step the scenario describes runs compressed (and has any effect)."""
    g = spec_of(s)
    if g.method == "none" or s.parallel.dp == 1:
        return False
    if g.method in WIRE_BYTES:
        return WIRE_BYTES[g.method] < dtype_bytes(s.training.dtype)
    return g.step is None or g.step >= warmup_steps(g)


def effective_method(s: Scenario) -> str:
    """The method the modelled step runs: ``none`` in a warm-up step or without effect."""
    return spec_of(s).method if compressed_step(s) else "none"


# ---------------------------------------------------------------- PowerSGD


def layer_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """A dense layer's gradient tensors as (rows, columns): nn.Linear weights are
    (out, in); biases and norm weights are n×1. Their elements sum to
    :func:`simulator.model.transformer.layer_params`."""
    h, f, q, kvw = spec.hidden, spec.ffn, spec.q_width, spec.kv * spec.head_size
    shapes = [(q, h), (kvw, h), (kvw, h), (h, q)]
    up = 2 if spec.activation == "swiglu" else 1
    shapes += [(f, h)] * up + [(h, f)]
    if spec.bias:
        shapes += [(q, 1), (kvw, 1), (kvw, 1), (h, 1)] + [(f, 1)] * up + [(h, 1)]
    norm = [(h, 1)] * (2 if spec.norm == "layernorm" else 1)
    return shapes + norm * 2


def unit_shapes(spec: ModelSpec, layers: int, first: bool, last: bool,
                tied_copy: bool) -> list[list[tuple[int, int]]]:
    """Per gradient unit of a stage, in the order :meth:`Context.grad_bytes` lists
    them: one per layer (the head's tensors with the first, as the backward runs it
    first), then the embedding's on the first stage."""
    units = [layer_shapes(spec) for _ in range(layers)]
    if last:
        norm = [(spec.hidden, 1)] * (2 if spec.norm == "layernorm" else 1)
        head = [(spec.vocab, spec.hidden)] if not spec.tied_embeddings else []
        copy = [(spec.vocab, spec.hidden)] if tied_copy else []
        if units:
            units[0] = units[0] + norm + head + copy
        else:  # a last stage without layers (parallel.layers_per_stage): its own unit
            units.append(norm + head + copy)
    if first:
        units.append([(spec.vocab, spec.hidden)]
                     + ([(spec.seq_len, spec.hidden)] if spec.position == "learned" else []))
    return units


@dataclass(frozen=True)
class PowerSGDBucket:
    """One bucket under the hook: its compressed matrices (n, m, r) and element counts."""

    matrices: tuple[tuple[int, int, int], ...]
    elements: int  # every gradient element of the bucket (the error buffer's length)
    uncompressed: int  # elements all-reduced as they are
    p: int  # Σ n·r
    q: int  # Σ m·r


def powersgd_bucket(shapes: Sequence[tuple[int, int]], rank: int,
                    min_rate: float) -> PowerSGDBucket:
    """Split a bucket's tensors as ``_should_compress`` does."""
    matrices, unc, p, q, total = [], 0, 0, 0, 0
    for n, m in shapes:
        total += n * m
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            matrices.append((n, m, r))
            p, q = p + n * r, q + m * r
        else:
            unc += n * m
    return PowerSGDBucket(tuple(matrices), total, unc, p, q)


def fp32_gemm(name: str, m: float, k: float, n: float) -> Op:
    flops = 2.0 * m * k * n
    return Op(name, "gemm", flops, HOOK_BYTES * (m * k + k * n + m * n), flops)


def _pass(name: str, nbytes: float) -> Op:
    return Op(name, "memory", 0.0, nbytes, 0.0)


def _orthogonalise(name: str, rows: int, r: int) -> Op:
    """QR (r > 2) or Gram-Schmidt of a rows×r matrix: about r passes over it."""
    return _pass(name, HOOK_BYTES * rows * r * 2 * r)


def powersgd_phases(b: PowerSGDBucket) -> tuple[list[Op], list[Op], list[Op]]:
    """The hook's kernels for one bucket, in its three phases: before the P
    all-reduce, between P and Q, after Q."""
    e, w = b.elements, HOOK_BYTES
    first = [_pass("powersgd.error_add", 3 * w * e), _pass("powersgd.copy", 2 * w * e)]
    second, third = [], []
    for n, m, r in b.matrices:
        first += [_orthogonalise("powersgd.orth_q", m, r), fp32_gemm("powersgd.p=mq", n, m, r)]
        second += [_orthogonalise("powersgd.orth_p", n, r), fp32_gemm("powersgd.q=mtp", m, n, r)]
        third.append(fp32_gemm("powersgd.m=pqt", n, r, m))
    third += [_pass("powersgd.error_store", 3 * w * e),
              _pass("powersgd.unpack_uncompressed", 3 * w * b.uncompressed)]
    return first, second, third


# ---------------------------------------------------------------- 1-bit Adam


def onebit_ops(elements: float, n: int) -> tuple[list[Op], list[Op], list[Op]]:
    """``compressed_allreduce`` of ``elements`` momentum values over n ranks: the
    worker's compression, the server's (its 1/n chunk), the final unpacking."""
    worker = [_pass("onebit.worker_compress", _COMPRESS_BYTES * elements)]
    server = [_pass("onebit.server_unpack", (_UNPACK_BYTES + 4 / n) * elements),
              _pass("onebit.server_compress", _COMPRESS_BYTES * elements / n)]
    final = [_pass("onebit.unpack", (_UNPACK_BYTES - 4 + _FINAL_COPY_BYTES) * elements)]
    return worker, server, final


def onebit_collectives(elements: float, n: int) -> list[tuple[str, CollectiveName, float]]:
    """(phase, op, bytes of the whole array) of one compressed all-reduce."""
    signs = elements / 8
    return [("worker", "all_to_all", signs), ("worker", "all_gather", 4.0 * n),
            ("server", "all_gather", signs), ("server", "all_gather", 4.0 * n)]


# ---------------------------------------------------------------- bf16 / fp8


def cast_ops(elements: float, dt: int, wire: int) -> tuple[list[Op], list[Op]]:
    """Cast a bucket to the wire format (fp8 reads it once more for its scale) and back."""
    scale = dt * elements if wire == 1 else 0.0
    down = [_pass("cast.to_wire", (dt + wire) * elements + scale)]
    return down, [_pass("cast.from_wire", (dt + wire) * elements)]


# ---------------------------------------------------------------- per stage


def stage_units(s: Scenario, stage: int) -> list[list[tuple[int, int]]]:
    """The gradient units of pipeline ``stage`` (all its chunks; a dense model)."""
    par, spec = s.parallel, s.model
    layers = placement.stage_layer_count(spec.layers, par, stage, spec.mtp_layers)
    return unit_shapes(spec, layers, placement.holds_embedding(par, stage),
                       placement.holds_head(par, stage),
                       spec.head_needs_embedding and placement.tied_copy(par))


def stage_shapes(s: Scenario, stage: int) -> list[tuple[int, int]]:
    """Every gradient tensor of pipeline ``stage`` (a dense model, before the TP split)."""
    return [shape for unit in stage_units(s, stage) for shape in unit]


def stage_elements(s: Scenario, stage: int) -> float:
    """Gradient elements on one rank of ``stage`` (its TP shard), in closed form: the
    layers' (equal) tensors times the layer count, plus the ends' (no list of a
    billion layers)."""
    par, spec = s.parallel, s.model
    layers = placement.stage_layer_count(spec.layers, par, stage, spec.mtp_layers)
    ends = unit_shapes(spec, 0, placement.holds_embedding(par, stage),
                       placement.holds_head(par, stage),
                       spec.head_needs_embedding and placement.tied_copy(par))
    total = layers * sum(n * m for n, m in layer_shapes(spec)) \
        + sum(n * m for unit in ends for n, m in unit)
    return total / par.tp


def _bucket_elements(s: Scenario, total: float) -> float:
    """Elements of the (at most two) buckets in flight."""
    per_bucket = s.parallel.dp_bucket_MB * 1e6 / dtype_bytes(s.training.dtype)
    return min(2 * per_bucket, total)


def memory_extra(s: Scenario, stage: int) -> tuple[float, float]:
    """(communication-buffer, optimizer-state) bytes the method adds on one rank of
    ``stage``: the hook's error buffer, P, Q and bucket copies; 1-bit Adam's worker and
    server errors (held from the first step, warm-up included); the cast buckets."""
    g, par = spec_of(s), s.parallel
    if par.dp == 1 or g.method == "none":
        return 0.0, 0.0
    elements = stage_elements(s, stage)
    if g.method == "onebit_adam":
        return 0.0, HOOK_BYTES * elements * (1 + 1 / par.dp)
    if not compressed_step(s):
        return 0.0, 0.0
    if g.method == "powersgd":
        b = powersgd_bucket(stage_shapes(s, stage), rank_of(g), min_rate(g))
        return HOOK_BYTES * (b.elements + b.p + b.q + _bucket_elements(s, elements)), 0.0
    return WIRE_BYTES[g.method] * _bucket_elements(s, elements), 0.0


def min_rate(g: GradientCompressionSpec) -> float:
    return g.min_compression_rate if g.min_compression_rate is not None \
        else POWERSGD_MIN_COMPRESSION_RATE


def _bus(op: str, n: int) -> float:
    """Bytes each rank sends per byte of the array (nccl-tests' busbw factors)."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def gradient_collectives(s: Scenario, stage: int,
                         method: str) -> list[tuple[CollectiveName, float]]:
    """(op, bytes of the array) of every data-parallel gradient reduction one rank of
    ``stage`` takes part in per step under ``method`` (bucketing aside: a bucketed
    reduction moves the same bytes)."""
    par, dt = s.parallel, dtype_bytes(s.training.dtype)
    elements = stage_elements(s, stage)
    if method == "powersgd":
        b = powersgd_bucket(stage_shapes(s, stage), rank_of(spec_of(s)), min_rate(spec_of(s)))
        return [("all_reduce", HOOK_BYTES * x) for x in (b.uncompressed, b.p, b.q) if x]
    if method == "onebit_adam":
        return [(op, size) for _, op, size in onebit_collectives(elements, par.dp)]
    wire = WIRE_BYTES.get(method, dt)
    times = s.microbatches if par.zero >= 2 else 1
    op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    return [(op, elements * wire)] * times


def compute_seconds(s: Scenario, stage: int, method: str) -> float:
    """The method's kernels per step on one rank of ``stage`` (fp32, the scenario's
    profile), its buckets taken together (they differ only in per-kernel overheads)."""
    par, dt = s.parallel, dtype_bytes(s.training.dtype)
    if method == "none" or par.dp == 1:
        return 0.0
    cost = CostModel(s.hardware, "fp32", host_us=s.stack.host_us, ranks=par.world)
    elements = stage_elements(s, stage)
    if method == "powersgd":
        b = powersgd_bucket(stage_shapes(s, stage), rank_of(spec_of(s)), min_rate(spec_of(s)))
        phases: Sequence[list[Op]] = powersgd_phases(b)
    elif method == "onebit_adam":
        phases = onebit_ops(elements, par.dp)
    else:
        times = s.microbatches if par.zero >= 2 else 1
        phases = [ops * times for ops in cast_ops(elements, dt, WIRE_BYTES[method])]
    return sum(cost.ops_time(ops) for ops in phases)


def traffic(s: Scenario) -> dict[str, object]:
    """Gradient-reduction bytes per step and rank, compressed and uncompressed, per
    stage: ``reduced_bytes`` (the arrays reduced) and ``wire_bytes`` (what each rank
    sends, with nccl-tests' factors: 2(n−1)/n for an all-reduce, (n−1)/n otherwise), and
    ``compression_compute_s``, the method's kernels; the top level is the stage with the
    most uncompressed traffic."""
    par = s.parallel
    method = effective_method(s)
    stages = []
    for stage in range(par.pp):
        row: dict[str, float | int] = {"stage": stage}
        for key, m in (("", method), ("uncompressed_", "none")):
            colls = gradient_collectives(s, stage, m) if par.dp > 1 else []
            row[f"{key}reduced_bytes"] = sum(size for _, size in colls)
            row[f"{key}wire_bytes"] = sum(size * _bus(op, par.dp) for op, size in colls)
        row["compression_compute_s"] = compute_seconds(s, stage, method)
        stages.append(row)
    peak = max(stages, key=lambda r: r["uncompressed_wire_bytes"])
    wire, base = float(peak["wire_bytes"]), float(peak["uncompressed_wire_bytes"])
    return {"method": spec_of(s).method, "compressed_step": method != "none",
            "wire_bytes_per_gpu": wire, "uncompressed_wire_bytes_per_gpu": base,
            "saved_fraction": 1 - wire / base if base else 0.0,
            "compression_compute_s": float(peak["compression_compute_s"]), "per_stage": stages}


# ---------------------------------------------------------------- validation


def bucket_caps(s: Scenario) -> tuple[float, float]:
    """DDP's bucket caps in bytes: (the first bucket's, every later one's). The stack's
    ``ddp_first_bucket_MB`` when it is smaller than ``parallel.dp_bucket_MB``."""
    rest = s.parallel.dp_bucket_MB * 1e6
    first = s.stack.ddp_first_bucket_MB * 1e6
    return (first if 0 < first < rest else rest), rest


def buckets(sizes: Sequence[float], caps: tuple[float, float]) -> list[list[int]]:
    """DDP's buckets as the data pass fills them: units in backward order, a bucket
    closed once it holds its cap (:func:`bucket_caps`: the first bucket's, then the
    others'), the rest in a last bucket."""
    out: list[list[int]] = [[]]
    total = 0.0
    for i, size in enumerate(sizes):
        out[-1].append(i)
        total += size
        if total >= caps[len(out) > 1]:
            out.append([])
            total = 0.0
    return [b for b in out if b]
