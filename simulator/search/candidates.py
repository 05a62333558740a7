"""The planner's first pass: every candidate layout, in a fixed order.

A candidate is one value per dimension of the search: each strategy's
(:meth:`simulator.strategies.base.Strategy.dimensions`: TP dividing the heads and at
most a node unless ``tp_beyond_node``, CP, PP dividing the layers with DP = N / (TP · CP
· PP) whole, for a mixture of experts every EP degree the stage admits, every schedule
with the virtual-stage counts that give each chunk whole layers, every ZeRO stage,
sequence parallelism when TP > 1) and the planner's own (recompute mode, micro-batch
size). Dimensions nest by their order; a branch with no values is pruned. A strategy
registered beside the built-in ones adds its own dimensions, and :func:`knobs` its
columns.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError

from simulator.errors import Problem, UserError
from simulator.limits import MAX_CANDIDATES
from simulator.schedules import registry as schedules
from simulator.spec.load import scenario_from_dict
from simulator.spec.model_spec import preset_model_names
from simulator.spec.scenario import ParallelSpec, Scenario, TrainingSpec
from simulator.strategies import registry
from simulator.strategies.base import Dimension
from simulator.system.profiles import load_system

RECOMPUTE = ("none", "selective", "full")

#: A candidate's settings, one per knob, in :func:`knobs` order.
Candidate = tuple[Any, ...]


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for, and which part of the space to search."""

    model: str  # a model preset (`clustersim presets`)
    gpus: int  # N, a multiple of the system's GPUs per node (or a divisor of it)
    system: str  # a system preset or a hardware-profile YAML
    global_batch: int  # sequences per step
    seq_len: int | None = None  # default: the preset's
    top_k: int = 5  # candidates re-simulated by the engine
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    # schedules to try; default every registered one
    schedules: tuple[str, ...] = field(default_factory=lambda: tuple(schedules.SCHEDULES))
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    # CP degrees; None: powers of two down to CP_MIN_TOKENS tokens a rank (cp_degrees)
    context_parallel: tuple[int, ...] | None = None
    # EP degrees (a mixture of experts only), each kept where the stage admits it;
    # None: every degree the schema accepts
    expert_parallel: tuple[int, ...] | None = None
    tp_beyond_node: bool = False  # allow TP groups that span nodes
    dtype: str = "bf16"
    max_candidates: int = MAX_CANDIDATES  # refuse a larger search (--max-candidates)


def base_scenario(req: PlanRequest) -> Scenario:
    """The model and cluster, validated once (training and parallel replaced later)."""
    if req.model not in preset_model_names():
        near = difflib.get_close_matches(req.model, preset_model_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise UserError([Problem("--model", req.model, f"not a model preset; {hint}bundled: "
                                 f"{', '.join(preset_model_names())}")])
    try:
        gpn = load_system(req.system).gpus_per_node
    except UserError as exc:
        raise UserError([Problem("--system", req.system, str(exc.problems[0]).split(": ", 1)[-1])
                         ]) from None
    if req.gpus % gpn == 0:
        nodes, per_node = req.gpus // gpn, gpn
    elif gpn % req.gpus == 0:
        nodes, per_node = 1, req.gpus
    else:
        raise UserError([Problem("--gpus", req.gpus, f"{req.system} has {gpn} GPUs per node; "
                                 f"use a multiple of {gpn} (or a divisor of it)")])
    model: dict[str, Any] = {"preset": req.model}
    if req.seq_len is not None:
        model["seq_len"] = req.seq_len
    data = {"name": f"plan-{req.model}-{req.gpus}", "model": model,
            "cluster": {"system": req.system, "nodes": nodes, "gpus_per_node": per_node},
            "parallel": {"dp": req.gpus},
            "training": {"global_batch": req.gpus, "dtype": req.dtype},
            "simulation": {"method": "engine", "fidelity": "folded"}}
    base = scenario_from_dict(data)
    base.hardware  # noqa: B018  resolve once; candidates share it through model_copy
    try:
        training = TrainingSpec(global_batch=req.global_batch, dtype=cast(Any, req.dtype))
    except ValidationError as exc:
        raise UserError([Problem("--global-batch", req.global_batch,
                                 exc.errors()[0]["msg"])]) from None
    return base.model_copy(update={"training": training})


def _micro_batches(req: PlanRequest, base: Scenario,
                   chosen: Mapping[str, Any]) -> Iterator[tuple[int]]:
    return ((b,) for b in req.micro_batches if b * chosen["dp"] <= req.global_batch)


#: The planner's own dimensions, beside the strategies'.
PLANNER_DIMENSIONS = (
    Dimension(("recompute",), ("parallel.recompute",), 80,
              lambda req, base, chosen: ((r,) for r in req.recompute)),
    Dimension(("micro_batch",), ("training.micro_batch",), 100, _micro_batches),
)


def dimensions() -> list[Dimension]:
    """Every dimension of the search, in nesting order."""
    dims = [d for st in registry.strategies() for d in st.dimensions()]
    return sorted([*dims, *PLANNER_DIMENSIONS], key=lambda d: d.order)


def knobs() -> tuple[str, ...]:
    """The plan table's setting columns, in candidate order."""
    return tuple(k for d in dimensions() for k in d.knobs)


#: The built-in strategies' knobs (a strategy registered later adds to :func:`knobs`).
KNOBS = knobs()


def candidates(req: PlanRequest, base: Scenario) -> list[Candidate]:
    """Every layout of pass 1, in a fixed order."""
    if not base.model.is_moe and any(ep > 1 for ep in req.expert_parallel or ()):
        raise UserError([Problem("--expert-parallel", req.expert_parallel, f"{req.model} has "
                                 "no routed experts (model.experts = 0); leave it out")])
    dims, names = dimensions(), knobs()
    chosen: dict[str, Any] = {}
    out: list[Candidate] = []

    def walk(i: int) -> None:
        if i == len(dims):
            out.append(tuple(chosen[k] for k in names))
            if len(out) > req.max_candidates:  # stop here: the rest is not enumerated
                raise UserError([Problem("--gpus", req.gpus, f"{req.model} on {req.gpus:,} "
                                         f"GPUs makes more than {req.max_candidates:,} "
                                         "candidate layouts; narrow the search "
                                         "(--micro-batches, --context-parallel, "
                                         "--expert-parallel), or raise the limit with "
                                         "--max-candidates N")])
            return
        for values in dims[i].values(req, base, chosen):
            chosen.update(zip(dims[i].knobs, values, strict=True))
            walk(i + 1)

    walk(0)
    return out


def candidate_scenario(base: Scenario, cand: Candidate) -> Scenario:
    """``base`` with a candidate's settings (field checks run; cross-field ones do not)."""
    fields = dict(zip((f for d in dimensions() for f in d.fields), cand, strict=True))
    parallel = {k.removeprefix("parallel."): v for k, v in fields.items()
                if k.startswith("parallel.")}
    par = ParallelSpec(**cast(Any, parallel))
    trn = TrainingSpec(global_batch=base.training.global_batch,
                       micro_batch=fields["training.micro_batch"], dtype=base.training.dtype)
    update: dict[str, Any] = {"parallel": par, "training": trn}
    options = {k.removeprefix("strategies."): v for k, v in fields.items()
               if k.startswith("strategies.")}
    if options:
        sections: dict[str, dict[str, Any]] = {n: dict(o) for n, o in base.strategies.items()}
        for key, value in options.items():
            name, _, option = key.partition(".")
            sections.setdefault(name, {})[option] = value
        update["strategies"] = sections
    return base.model_copy(update=update)
