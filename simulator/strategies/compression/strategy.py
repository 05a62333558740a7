"""Gradient compression as a strategy: its fields' rules and warnings, and its closed
form (the buckets' compressed reductions one after the other, 1-bit Adam's momentum
exchange). Its tasks are the data pass's
(:class:`~simulator.strategies.compression.workload.Compressor`), its memory
:func:`~simulator.strategies.compression.arithmetic.memory_extra`.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.errors import Problem
from simulator.model.inventory.ops import dtype_bytes
from simulator.spec.placement import stage_layer_count
from simulator.spec.scenario import Scenario
from simulator.strategies.base import Strategy
from simulator.strategies.compression import arithmetic as cmp
from simulator.strategies.compression.arithmetic import (
    FIELDS,
    WIRE_BYTES,
    compressed_step,
    effective_method,
    spec_of,
)
from simulator.strategies.timing import collective_time
from simulator.system.costs import CostModel
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout
from simulator.system.units import CollectiveName


def compression_problems(s: Scenario) -> list[Problem]:
    """What the real implementations refuse, and what this simulator does not model."""
    g, par = spec_of(s), s.parallel
    key = "training.gradient_compression"
    out: list[Problem] = []
    for name, owner in FIELDS.items():
        if getattr(g, name) is not None and g.method != owner:
            out.append(Problem(f"{key}.{name}", getattr(g, name), f"only for method {owner} "
                               f"(method is {g.method}); remove it"))
    if g.step is not None and g.method not in ("powersgd", "onebit_adam"):
        out.append(Problem(f"{key}.step", g.step, "only for powersgd and onebit_adam (the "
                           "methods with a warm-up); remove it"))
    if g.method == "none":
        return out
    if s.model.is_moe or s.model.mla is not None:
        out.append(Problem(f"{key}.method", g.method, "gradient compression is modelled for "
                           "dense models only; use method: none"))
    if g.method == "powersgd":
        if par.zero:
            out.append(Problem(f"{key}.method", g.method, f"PyTorch's PowerSGD is a DDP "
                               f"communication hook (whole buckets all-reduced); ZeRO-{par.zero}"
                               " reduces shards; use parallel.zero: 0"))
        if par.tp > 1:
            out.append(Problem(f"{key}.method", g.method, f"PowerSGD of tensor-parallel shards "
                               f"is not modelled (tp = {par.tp}); use parallel.tp: 1"))
        if g.start_step is not None and g.start_step < 2:
            out.append(Problem(f"{key}.start_step", g.start_step, "must be >= 2: PyTorch's "
                               "PowerSGDState refuses start_powerSGD_iter <= 1 with error "
                               "feedback (DDP rebuilds its buckets after the first step)"))
    if g.method == "onebit_adam" and par.zero:
        out.append(Problem(f"{key}.method", g.method, "DeepSpeed refuses it with ZeRO "
                           "(\"1bit-Adam is not compatible with ZeRO\", runtime/engine.py); "
                           "use parallel.zero: 0"))
    return out


def compression_warnings(s: Scenario) -> list[str]:
    g = spec_of(s)
    if g.method == "none":
        return []
    if s.parallel.dp == 1:
        return [f"warning: training.gradient_compression.method = {g.method} with dp = 1: "
                "there is no data-parallel reduction to compress"]
    if g.method in WIRE_BYTES and not compressed_step(s):
        return [f"warning: training.gradient_compression.method = {g.method}: gradients are "
                f"already {s.training.dtype} on the wire; it changes nothing"]
    return []


def compressed_reduction(s: Scenario, layout: Layout, hw: HardwareProfile,
                          cost: CostModel, window: float, stage: int) -> tuple[float, float]:
    """(exposed time, its compute) of ``stage``'s gradient buckets reduced one after the
    other by PowerSGD or a bf16/fp8 wire (:mod:`simulator.strategies.compression.workload`). A
    bucket's chain starts when its last layer's gradients are ready (the layers spread
    evenly over the last backward, ``window`` long; 0 without overlap) and the previous
    chain has ended; what runs after the backward is exposed."""
    par, spec, g = s.parallel, s.model, cmp.spec_of(s)
    method = cmp.effective_method(s)
    dt = s.stack.reduce_bytes(dtype_bytes(s.training.dtype))  # what the buckets hold
    if method == "onebit_adam":
        return 0.0, 0.0
    fp32 = replace(cost, hw=hw, dtype="fp32")
    group = layout.dp_group(0)
    op: CollectiveName = "all_reduce" if par.zero == 0 else "reduce_scatter"
    units = cmp.stage_units(s, stage)
    sizes = [sum(n * m for n, m in u) / par.tp * dt for u in units]
    per_unit = par.zero == 3
    groups = [[i] for i in range(len(sizes))] if per_unit \
        else cmp.buckets(sizes, cmp.bucket_caps(s))
    times = s.microbatches if par.zero >= 2 else 1
    layers = max(stage_layer_count(spec.layers, par, stage, spec.mtp_layers), 1)
    clock = exposed = compute = 0.0
    for bucket in groups:
        if method == "powersgd":
            b = cmp.powersgd_bucket([x for i in bucket for x in units[i]], cmp.rank_of(g),
                                    cmp.min_rate(g))
            comp = sum(fp32.ops_time(ops) for ops in cmp.powersgd_phases(b))
            comm = sum(collective_time(s, layout, "all_reduce", cmp.HOOK_BYTES * x, group, hw)
                       for x in (b.uncompressed, b.p, b.q))
        else:
            size = sum(sizes[i] for i in bucket)
            wire = cmp.WIRE_BYTES[method]
            comp = sum(fp32.ops_time(ops) for ops in cmp.cast_ops(size / dt, dt, wire))
            comm = collective_time(s, layout, op, size * wire / dt, group, hw)
        ready = window * min(bucket[-1] + 1, layers) / layers
        start = max(clock, ready)
        clock = start + times * (comp + comm)
        late = min(clock - window, clock - start) if clock > window else 0.0
        exposed += late
        compute += late * comp / (comp + comm) if comp + comm else 0.0
    return exposed, compute


def momentum_exchange(s: Scenario, layout: Layout, hw: HardwareProfile,
                       cost: CostModel, stage: int) -> tuple[float, float]:
    """(all of it, its compute) of 1-bit Adam's compressed momentum all-reduce."""
    if cmp.effective_method(s) != "onebit_adam":
        return 0.0, 0.0
    par, n = s.parallel, s.parallel.dp
    fp32 = replace(cost, hw=hw, dtype="fp32")
    elements = cmp.stage_elements(s, stage)
    compute = sum(fp32.ops_time(ops) for ops in cmp.onebit_ops(elements, n))
    comm = sum(collective_time(s, layout, op, size, layout.dp_group(0), hw)
               for _, op, size in cmp.onebit_collectives(elements, par.dp))
    return compute + comm, compute


class Compression(Strategy):
    name = "compression"

    def active(self, s: Scenario) -> bool:
        return effective_method(s) != "none"

    def problems(self, s: Scenario) -> list[Problem]:
        return compression_problems(s)

    def warnings(self, s: Scenario) -> list[str]:
        return compression_warnings(s)


COMPRESSION = Compression()
