"""``clustersim ops``: the op inventory of one layer as the scenario's stack runs it.

One row per op of the first layer (its first MoE layer too, for a mixture of experts)
on one TP rank for one micro-batch: pass (forward, backward input, backward weight,
recompute), cost class, kernels, GFLOP (counted), MB moved, what it keeps for backward,
its time on the scenario's hardware (:class:`simulator.system.costs.CostModel`), what bounds it
(compute, memory, or overhead: launch or host) and its share of the layer. Then the
ends (embedding, head and loss), the trainer's metric updates after each backward
(``trainer``, where the stack has them) and the optimizer step of the first stage's
shard, which are not part of the layer's share; under ZeRO-3 with a stack that has FSDP2's copies,
the copies around one layer's all-gather and reduce-scatter (``fsdp unit``, the
accumulate as on a micro-batch after the first); under DDP with a stack that has torch
DDP's bucket copies, one layer's gradients into their bucket and back (``ddp layer``).
Rows are plain dicts, so the table prints, or goes to CSV, from the same data.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from simulator.builder.workload import local_scenario
from simulator.model import moe
from simulator.model import transformer as mdl
from simulator.model.inventory.attention import context_parallel_ops
from simulator.model.inventory.layer import layer_tensors
from simulator.model.inventory.ops import Op, dtype_bytes
from simulator.model.inventory.sharding import ddp_copy_ops, fsdp_gather_ops, fsdp_reduce_ops
from simulator.model.memory import activation_bytes_per_layer, stage_params
from simulator.spec.placement import stage_layers
from simulator.spec.recompute import layer_mode
from simulator.spec.scenario import Scenario
from simulator.system.costs import CostModel

COLUMNS = ("part", "pass", "op", "class", "kernels", "gflop", "mb", "saved_mb", "time_us",
           "bound", "share")
_PASS_NAMES = {"fwd": "forward", "bwd_input": "backward input", "bwd_weight": "backward weight"}


def _row(cost: CostModel, part: str, pass_: str, op: Op) -> dict[str, Any]:
    return {"part": part, "pass": pass_, "op": op.name, "class": op.cost_class,
            "kernels": op.kernels, "gflop": op.flops / 1e9, "mb": op.bytes / 1e6,
            "saved_mb": op.saved / 1e6, "time_us": cost.op_time(op) * 1e6,
            "bound": cost.bound(op), "share": 0.0}


def _layer_rows(s: Scenario, cost: CostModel, layer: int, part: str) -> list[dict[str, Any]]:
    spec, b, tp, sp, dt = (s.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)
    cp, gathered = s.parallel.cp, s.parallel.cp_comm_type == "allgather"
    rows = []
    for p in mdl.PASSES:
        ops = context_parallel_ops(mdl.layer_ops(spec, b, tp, sp, dt, p, layer, s.stack),
                                       spec, b, tp, dt, p, cp, gathered,
                                       s.cp_keeps_gathered_kv, s.parallel.cp_a2a_degree)
        rows += [_row(cost, part, _PASS_NAMES[p], op) for op in ops]
    mode = layer_mode(s.parallel, spec.layers, layer)  # only some layers may be recomputed
    rec = mdl.layer_recompute_ops(spec, b, tp, sp, dt, mode, layer, s.stack)
    rec = context_parallel_ops(rec, spec, b, tp, dt, "fwd", cp, gathered,
                               a2a=s.parallel.cp_a2a_degree)
    rows += [_row(cost, part, "recompute", op) for op in rec]
    total = sum(r["time_us"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["time_us"] / total
    return rows


def op_rows(s: Scenario) -> list[dict[str, Any]]:
    """Every row of the table (see the module docstring)."""
    cost = CostModel(s.hardware, s.training.dtype, host_us=s.stack.host_us)
    local = local_scenario(s)
    kinds = moe.layer_kinds(local.model)
    rows = _layer_rows(local, cost, kinds[0][0], f"layer {kinds[0][0]}")
    for i, _ in kinds[1:]:
        rows += _layer_rows(local, cost, i, f"layer {i} (MoE)")
    spec, b, tp, sp, dt = (local.model, s.training.micro_batch, s.parallel.tp,
                           s.parallel.sequence_parallel, s.training.dtype)
    ends = [("embedding", mdl.embedding_ops), ("head", mdl.head_ops)]
    if spec.mtp_layers:  # one multi-token prediction module's ops beside its layer
        ends.append(("mtp module", mdl.mtp_end_ops))
    for part, fn in ends:
        for p in mdl.PASSES:
            rows += [_row(cost, part, _PASS_NAMES[p], op)
                     for op in fn(spec, b, tp, sp, dt, p, s.stack)]
    rows += [_row(cost, "trainer", "after backward", op)  # its metrics on the logits
             for op in mdl.train_metric_ops(spec, b, tp, sp, dt, s.stack)]
    par = s.parallel
    if par.zero == 3 and par.dp * par.cp > 1:  # FSDP's kernels around one layer's collectives
        unit, n, dp = mdl.layer_params(s.model) / tp, layer_tensors(s.model, s.stack), \
            par.shard
        dtb = dtype_bytes(dt)
        rows += [_row(cost, "fsdp unit", "per gather", op)
                 for op in fsdp_gather_ops(s.stack, unit, dp, dtb, n)]
        rows += [_row(cost, "fsdp unit", "per reduce", op) for op in fsdp_reduce_ops(
            s.stack, unit, dp, dtb, s.stack.reduce_bytes(dtb), n, True, par.dp * par.cp // dp)]
    if par.zero == 0 and par.dp * par.cp > 1:  # torch DDP's bucket copies of one layer
        unit, n = mdl.layer_params(s.model) / tp, layer_tensors(s.model, s.stack)
        rdt = s.stack.reduce_bytes(dtype_bytes(dt))
        rows += [_row(cost, "ddp layer", "into bucket" if not back else "bucket back", op)
                 for back in (False, True) for op in ddp_copy_ops(s.stack, unit, rdt, n, back)]
    shard = stage_params(s.model, par.pp, 0) / par.tp / (par.shard if par.zero else 1)
    runs = stage_layers(s.model.layers, par, 0, s.model.mtp_layers)
    opt = mdl.optimizer_op_of(s, shard, runs, "all")
    rows.append(_row(cost, "optimizer", "step", opt))
    return rows


def format_table(s: Scenario, rows: list[dict[str, Any]]) -> str:
    """The table as text, with a header naming the scenario, stack and hardware."""
    st = s.stack
    lines = [f"{s.name}: one micro-batch ({s.training.micro_batch} x {s.model.seq_len} tokens) "
             f"on one TP rank of {s.parallel.tp}, stack {st.name} ({st.attention} attention, "
             f"dropout {st.attention_dropout:g}/{st.hidden_dropout:g}, main grads "
             f"{st.main_grads}, host {st.host_us:g} us/kernel), {s.hardware.gpu.name}",
             f"{'part':<16}{'pass':<16}{'op':<18}{'class':<14}{'kern':>5}{'GFLOP':>10}"
             f"{'MB':>10}{'saved MB':>10}{'time us':>11}  {'bound':<9}{'share':>6}"]
    for r in rows:
        share = f"{100 * r['share']:5.1f}%" if r["share"] else ""
        lines.append(f"{r['part']:<16}{r['pass']:<16}{r['op']:<18}{r['class']:<14}"
                     f"{r['kernels']:>5}{r['gflop']:>10.2f}{r['mb']:>10.1f}{r['saved_mb']:>10.1f}"
                     f"{r['time_us']:>11.1f}  {r['bound']:<9}{share:>6}")
    first = rows[0]["part"]
    layer = [r for r in rows if r["part"] == first]
    par, b = s.parallel, s.training.micro_batch
    mode = layer_mode(par, s.model.layers, 0)
    kept = activation_bytes_per_layer(s.model, b, par.tp, par.sequence_parallel, mode,
                                      s.training.dtype, 0, par.cp, s.stack,
                                      s.cp_keeps_gathered_kv, par.cp_a2a_degree > 1)
    lines.append(f"{first} total {sum(r['time_us'] for r in layer) / 1e3:.3f} ms, "
                 f"{sum(r['kernels'] for r in layer)} kernels; kept for backward "
                 f"{kept / 1e6:.1f} MB (the memory model's, under recompute "
                 f"{mode})")
    return "\n".join(lines)


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
