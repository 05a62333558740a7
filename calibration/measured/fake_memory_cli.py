"""``clustersim fake-memory SCENARIO``: PyTorch's own accounting of one FSDP2 step
(:mod:`calibration.measured.fake_memory`) beside the simulator's memory table.

The scenario must be one the measured model expresses: a dense GPT-2 or Llama block
(``calibration/measured/gpt.py``, ``llama.py``) under FSDP2 (``parallel.zero: 3``), no
TP, PP, CP, experts or hybrid sharding, recompute ``none``, ``full`` or ``op``
(torchtitan's per-op policy). Anything else is a one-line error (exit 2).

Prints per item the simulator's bytes (stage 0 of :func:`simulator.analysis.memory.
memory_report`) and the tracker's at its forward-and-backward peak and over the whole
step, then the moment of each side's peak (the tracker's unit, the simulator's
:func:`simulator.strategies.zero3.buffers.zero3_peak`), and with ``--out DIR`` writes
``DIR/memory.json`` and ``DIR/memory.txt``, each atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem, UserError

if TYPE_CHECKING:
    from calibration.measured.fake_memory import FakeStep
    from simulator.spec.scenario import Scenario

HELP = ("PyTorch's own memory accounting (FakeTensorMode, FSDPMemTracker) of one FSDP2 "
        "step of the scenario, beside the simulator's memory table")
EXAMPLE = ("example:\n  clustersim fake-memory scenarios/llama3-8b-8xh100-torchtitan.yaml "
           "--set parallel.recompute=full --out /tmp/fm")
#: item rows of the table: name -> (our MemoryBreakdown fields, the tracker's items)
ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "weights": (("weights",), ("weights",)),
    "grads": (("gradients",), ("grads",)),
    "optimizer": (("optimizer",), ("optimizer",)),
    "activations": (("activations", "logits"), ("activations",)),
    "temporaries": ((), ("temporaries",)),
    "buffers": (("comm_buffers",), ("buffers",)),
}
ARCH = {("swiglu", "rmsnorm", "rope", False): "llama", ("gelu", "layernorm", "learned", True):
        "gpt"}


def _refuse(field: str, value: object, fix: str) -> UserError:
    return UserError([Problem(field, value, f"the measured FSDP2 model cannot express it; {fix}")])


def _check_parallel(s: Scenario) -> None:
    par = s.parallel
    if par.zero != 3:
        raise _refuse("parallel.zero", par.zero, "set parallel.zero=3 (FSDP2)")
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(par, name) != 1:
            raise _refuse(f"parallel.{name}", getattr(par, name), f"set parallel.{name}=1")
    if par.dp_shard not in (None, par.dp):
        raise _refuse("parallel.dp_shard", par.dp_shard, "leave it unset (no hybrid sharding)")
    if par.recompute not in ("none", "full", "op") or par.recompute_num_layers:
        raise _refuse("parallel.recompute", par.recompute, "use none, full or op on every layer")
    if s.training.dtype != "fp32" and not s.stack.fp32_params(2):
        raise _refuse("stack.master_weights", s.stack.master_weights, "FSDP2's "
                      "MixedPrecisionPolicy keeps fp32 parameters as the master; use a stack "
                      "with master_weights: parameters (torchtitan)")
    if s.training.optimizer != "adamw":
        raise _refuse("training.optimizer", s.training.optimizer, "use adamw")


def fake_step(s: Scenario) -> FakeStep:
    """The tracked step of ``s``, or a one-line :class:`UserError` naming what the
    measured model cannot express."""
    from calibration.measured.fake_memory import DTYPES, FakeStep
    from calibration.measured.gpt import GPTConfig

    m = s.model
    if m.is_moe or m.mla is not None or m.mtp_layers:
        raise _refuse("model", m.preset or "model", "use a dense model without MLA or MTP")
    arch = ARCH.get((m.activation, m.norm, m.position, m.bias))
    if arch is None:
        raise _refuse("model.activation", m.activation, "use Llama's block (swiglu, rmsnorm, "
                      "rope, no bias) or GPT-2's (gelu, layernorm, learned, bias)")
    if m.head_size * m.heads != m.hidden:
        raise _refuse("model.head_dim", m.head_dim, "use hidden / heads")
    _check_parallel(s)
    if s.training.dtype not in DTYPES:
        raise _refuse("training.dtype", s.training.dtype, f"use one of {', '.join(DTYPES)}")
    try:
        sizes = GPTConfig(layers=m.layers, hidden=m.hidden, heads=m.heads,
                          ffn_hidden=m.ffn, vocab=m.vocab, seq_len=m.seq_len,
                          kv_heads=m.kv if arch == "llama" else 0, arch=arch)
    except ValueError as exc:
        raise UserError([Problem("model", m.preset or "model", str(exc))]) from None
    return FakeStep(sizes=sizes, tied=m.tied_embeddings, shards=s.parallel.dp,
                    micro_batch=s.training.micro_batch, param_dtype=s.training.dtype,
                    reduce_dtype=("fp32" if s.stack.grad_reduce_dtype == "fp32"
                                  else s.training.dtype),
                    recompute=s.parallel.recompute,
                    reshard_after_forward=s.parallel.reshard_after_forward,
                    microbatches=s.microbatches)


def simulated(s: Scenario) -> dict[str, float]:
    """Stage 0's memory items in bytes, as ``clustersim memory`` prints them."""
    from simulator.analysis.memory import memory_report

    m = memory_report(s)[0]
    items = {row: float(sum(getattr(m, f) for f in fields)) for row, (fields, _) in ROWS.items()}
    items["device"] = float(m.runtime)
    return items


def comparison(sim: dict[str, float], tracked: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per item: ours, the tracker's at its forward-backward peak and at the whole
    step's, in bytes, and ours relative to the step's; a last row the tensors' total
    (ours less the device terms, which the tracker does not see)."""
    rows = []
    for row, (_, theirs) in ROWS.items():
        fb, st = (sum(tracked[k]["by_item"].get(t, 0) for t in theirs)
                  for k in ("forward_backward", "step"))
        rows.append({"item": row, "simulated": sim[row], "tracker_fwd_bwd": fb,
                     "tracker_step": st})
    rows.append({"item": "tensors", "simulated": sum(sim[r] for r in ROWS),
                 "tracker_fwd_bwd": tracked["forward_backward"]["peak_bytes"],
                 "tracker_step": tracked["step"]["peak_bytes"]})
    for r in rows:
        r["error"] = (r["simulated"] / r["tracker_step"] - 1) if r["tracker_step"] else None
    return rows


def simulated_moment(s: Scenario) -> str:
    """The moment of stage 0's backward the simulator's table holds
    (:func:`simulator.strategies.zero3.buffers.zero3_peak`: ``loss`` or ``block``)."""
    from simulator.strategies.zero3.buffers import zero3_peak

    return zero3_peak(s, 0).name


def moment_line(tracked: dict[str, Any], ours: str) -> str:
    """Where each side's peak is: the tracker's unit and moment, and ours."""
    at = tracked["peak_at"]
    where = f"{at['moment']} ({at['module']})" if at["module"] else at["moment"]
    return f"peak moment: tracker {where}, simulated {ours}"


def table(name: str, rows: list[dict[str, Any]]) -> str:
    gb = 1e9
    lines = [f"{name}: rank 0 in GB, the simulator beside FSDPMemTracker's peaks",
             f"{'item':<12} {'simulated':>10} {'fwd+bwd':>10} {'step':>10} {'sim/step':>9}"]
    for r in rows:
        err = "" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"{r['item']:<12} {r['simulated'] / gb:>10.3f} "
                     f"{r['tracker_fwd_bwd'] / gb:>10.3f} {r['tracker_step'] / gb:>10.3f} "
                     f"{err:>9}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    q = sub.add_parser("fake-memory", help=HELP, description=HELP, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("scenario", type=Path, help="scenario YAML file")
    q.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE", help="override a scenario key (repeatable)")
    q.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write DIR/memory.json and DIR/memory.txt (atomically)")
    q.set_defaults(func=run)


def _progress(start: float) -> Any:
    return lambda message: print(f"[{time.monotonic() - start:6.1f} s] {message}",
                                 file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.writing import atomic_output, check_dir_destination
    from simulator.spec.load import load_scenario
    from simulator.spec.rules import scenario_warnings

    s = load_scenario(args.scenario, args.overrides)
    for line in scenario_warnings(s):
        print(line, file=sys.stderr)
    step = fake_step(s)
    if args.out is not None:
        check_dir_destination(args.out)
    from calibration.measured.fake_memory import tracked_peak

    tracked = tracked_peak(step, _progress(time.monotonic()))
    rows = comparison(simulated(s), tracked)
    ours = simulated_moment(s)
    text = table(s.name, rows) + "\n" + moment_line(tracked, ours)
    print(text)
    if args.out is not None:
        doc = {"scenario": s.name, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "step": {k: str(v) for k, v in vars(step).items()},
               "tracker": tracked, "rows": rows, "simulated_moment": ours}
        with atomic_output(args.out / "memory.json", "--out") as tmp:
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
        with atomic_output(args.out / "memory.txt", "--out") as tmp:
            tmp.write_text(text + "\n")
    return 0
