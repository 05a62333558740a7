"""The planner's first pass: every candidate layout, in a fixed order.

A candidate is one value per dimension of the search: each strategy's
(:meth:`simulator.strategies.base.Strategy.dimensions`: TP dividing the heads and at
most an NVLink domain unless ``tp_beyond_node``, CP, PP dividing the layers with DP = N / (TP · CP
· PP) whole, for a mixture of experts every EP degree the stage admits, every schedule
with the virtual-stage counts that give each chunk whole layers, every ZeRO stage,
sequence parallelism when TP > 1) and the planner's own (:mod:`simulator.search.space`:
the CP exchange, the MoE token dispatcher, hybrid sharding, the recompute mode with
Megatron's modules, micro-batch size). Dimensions nest by their order; a branch with
no values is pruned. A strategy
registered beside the built-in ones adds its own dimensions, and :func:`knobs` its
columns.

The model is a preset or a YAML file holding a scenario's ``model`` section (or a
whole scenario, whose ``model`` section is taken); ``stack`` names a stack preset;
``sets`` are ``--set`` overrides as ``run`` takes them. An override of a searched
field (``parallel.zero=1``, ``training.micro_batch=2``) pins that dimension: only the
candidates with that value remain. Any other override (``parallel.dp_bucket_MB``,
``training.optimizer``, ``model.seq_len``) goes into the base scenario that every
candidate starts from.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError

from simulator.errors import Problem, UserError
from simulator.limits import MAX_CANDIDATES
from simulator.loading import parse_override, read_yaml
from simulator.schedules import registry as schedules
from simulator.search.choices import DEFAULT_CP_COMM, DISPATCHERS, MODULE_SETS, RECOMPUTE
from simulator.search.dominance import RULES
from simulator.search.headroom import DEFAULT_HEADROOM, Headroom
from simulator.search.space import PLANNER_DIMENSIONS, TO_FIELD, TO_KNOB
from simulator.spec.load import apply_overrides, scenario_from_dict
from simulator.spec.model_spec import preset_model_names
from simulator.spec.scenario import ParallelSpec, Scenario, TrainingSpec
from simulator.strategies import registry
from simulator.strategies.base import Dimension
from simulator.system.profiles import load_system

#: A candidate's settings, one per knob, in :func:`knobs` order.
Candidate = tuple[Any, ...]


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for, and which part of the space to search."""

    model: str  # a model preset (`clustersim presets`) or a model YAML file
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
    # Megatron's --recompute-modules sets tried with selective (beside its default)
    recompute_modules: tuple[str, ...] = MODULE_SETS
    # HSDP shard-group sizes tried under ZeRO-3 beside full sharding; None: each divisor
    # of dp whose group is whole nodes
    dp_shard: tuple[int, ...] | None = None
    cp_comm: tuple[str, ...] = DEFAULT_CP_COMM  # CP exchanges tried where cp > 1
    dispatchers: tuple[str, ...] = DISPATCHERS  # MoE token dispatchers (experts only)
    # CP degrees; None: powers of two down to CP_MIN_TOKENS tokens a rank (cp_degrees)
    context_parallel: tuple[int, ...] | None = None
    # EP degrees (a mixture of experts only), each kept where the stage admits it;
    # None: every degree the schema accepts
    expert_parallel: tuple[int, ...] | None = None
    tp_beyond_node: bool = False  # allow TP groups that span NVLink domains
    dtype: str = "bf16"
    stack: str | None = None  # a stack preset; None: the scenario default
    sets: tuple[str, ...] = ()  # ``--set key.path=value`` overrides (module note)
    # kept free on every GPU: no layout needs more than capacity − headroom
    headroom: Headroom = DEFAULT_HEADROOM
    max_candidates: int = MAX_CANDIDATES  # refuse a larger search (--max-candidates)

    @property
    def model_name(self) -> str:
        """The preset's name, or the model file's stem."""
        return Path(self.model).stem if _is_file(self.model) else self.model


def _is_file(model: str) -> bool:
    return model.endswith((".yaml", ".yml")) or Path(model).is_file()


def _model_section(model: str) -> dict[str, Any]:
    """``model``'s scenario section: ``{preset: NAME}``, or a YAML file's mapping."""
    if _is_file(model):
        data = read_yaml(Path(model), "--model")
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            data = data["model"]  # a whole scenario: its model section
        if not isinstance(data, dict):
            raise UserError([Problem("--model", model, "must hold a mapping: a scenario's "
                                     "model section, e.g. {preset: llama2-7b, seq_len: 8192}")])
        return data
    if model not in preset_model_names():
        near = difflib.get_close_matches(model, preset_model_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise UserError([Problem("--model", model, f"not a model preset; {hint}bundled: "
                                 f"{', '.join(preset_model_names())}; or a model .yaml file")])
    return {"preset": model}


def searched_fields() -> tuple[str, ...]:
    """The scenario fields the search sets, one per knob, in :func:`knobs` order."""
    return tuple(f for d in dimensions() for f in d.fields)


def split_sets(sets: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """``--set`` overrides as (those for the base scenario, pins of searched fields)."""
    searched, base, pins = set(searched_fields()), [], {}
    for text in sets:
        key, sep, raw = text.partition("=")
        if key.strip() in ("training.global_batch", "training.dtype") and sep:
            flag = "--global-batch" if key.strip().endswith("batch") else "the plan's dtype"
            raise UserError([Problem("--set", text, f"the plan sets {key.strip()}; use {flag}")])
        if sep and key.strip() in searched:
            pins[key.strip()] = parse_override(raw, f"--set {key.strip()}")
        else:
            base.append(text)
    return base, pins


def base_data(req: PlanRequest) -> dict[str, Any]:
    """The base scenario as its file would hold it (``--set`` overrides applied; parallel
    and training as placeholders the candidates replace)."""
    model = _model_section(req.model)
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
    if req.seq_len is not None:
        model["seq_len"] = req.seq_len
    system = str(Path(req.system).resolve()) if _is_file(req.system) else req.system
    data: dict[str, Any] = {
        "name": f"plan-{req.model_name}-{req.gpus}", "model": model,
        "cluster": {"system": system, "nodes": nodes, "gpus_per_node": per_node},
        "parallel": {"dp": req.gpus},
        "training": {"global_batch": req.gpus, "dtype": req.dtype},
        "simulation": {"method": "engine", "fidelity": "folded"}}
    if req.stack is not None:
        data["stack"] = {"preset": req.stack}
    return apply_overrides(data, split_sets(req.sets)[0])


def base_scenario(req: PlanRequest) -> Scenario:
    """The model and cluster, validated once (training and parallel replaced later)."""
    base = scenario_from_dict(base_data(req))
    base.hardware  # noqa: B018  resolve once; candidates share it through model_copy
    try:
        training = TrainingSpec.model_validate(
            {**base.training.model_dump(), "global_batch": req.global_batch})
    except ValidationError as exc:
        raise UserError([Problem("--global-batch", req.global_batch,
                                 exc.errors()[0]["msg"])]) from None
    return base.model_copy(update={"training": training})


def dimensions() -> list[Dimension]:
    """Every dimension of the search, in nesting order."""
    dims = [d for st in registry.strategies() for d in st.dimensions()]
    return sorted([*dims, *PLANNER_DIMENSIONS], key=lambda d: d.order)


def knobs() -> tuple[str, ...]:
    """The plan table's setting columns, in candidate order."""
    return tuple(k for d in dimensions() for k in d.knobs)


#: The built-in strategies' knobs (a strategy registered later adds to :func:`knobs`).
KNOBS = knobs()


def candidates(req: PlanRequest, base: Scenario, variants: bool = True) -> list[Candidate]:
    """Every layout of pass 1, in a fixed order; without ``variants``, only those no rule
    of :mod:`simulator.search.dominance` calls a variant (a pinned dimension keeps its
    every value): the planner's first round, whose siblings come later."""
    if not base.model.is_moe and any(ep > 1 for ep in req.expert_parallel or ()):
        raise UserError([Problem("--expert-parallel", req.expert_parallel, f"{req.model} has "
                                 "no routed experts (model.experts = 0); leave it out")])
    dims, names, pins = dimensions(), knobs(), split_sets(req.sets)[1]
    chosen: dict[str, Any] = {}
    out: list[Candidate] = []
    judged = {} if variants else {rule.knobs: rule.variant for rule in RULES}
    judged = {d.knobs: judged[d.knobs] for d in dims
              if d.knobs in judged and not set(d.fields) & set(pins)}

    def walk(i: int) -> None:
        if i == len(dims):
            out.append(tuple(chosen[k] for k in names))
            if len(out) > req.max_candidates:  # stop here: the rest is not enumerated
                raise too_many(req)
            return
        variant = judged.get(dims[i].knobs)
        for values in dims[i].values(req, base, chosen):
            if variant is not None and variant(values):
                continue
            chosen.update(zip(dims[i].knobs, values, strict=True))
            walk(i + 1)

    walk(0)
    return _pinned(out, pins)


def too_many(req: PlanRequest) -> UserError:
    """The error of a search above ``req.max_candidates``."""
    return UserError([Problem("--gpus", req.gpus, f"{req.model} on {req.gpus:,} GPUs makes "
                              f"more than {req.max_candidates:,} candidate layouts; narrow "
                              "the search (--micro-batches, --context-parallel, "
                              "--expert-parallel, --recompute-modules, --dp-shard, "
                              "--cp-comm), or raise the limit with --max-candidates N")])


def _pinned(cands: list[Candidate], pins: Mapping[str, Any]) -> list[Candidate]:
    """The candidates whose searched fields equal every pin (``--set`` of a knob)."""
    fields = searched_fields()
    for key, given in pins.items():
        i, value = fields.index(key), TO_KNOB.get(key, lambda v: v)(given)
        tried = sorted({c[i] for c in cands}, key=str)
        cands = [c for c in cands if c[i] == value]
        if not cands:
            raise UserError([Problem("--set", f"{key}={value}", "no candidate layout has it; "
                                     f"the search tried {', '.join(map(str, tried))}")])
    return cands


def is_set(value: Any) -> bool:
    """Whether a knob holds a value: None, and the NaN a table holds for it, do not."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


class CandidateScenarios:
    """Candidates' scenarios from one ``base``: what they all share (the searched fields,
    the base's own parallel settings, its training section) worked out once."""

    def __init__(self, base: Scenario) -> None:
        self.base = base
        self.names = knobs()
        self.fields = searched_fields()
        # the base's own parallel settings (--set ones: dp_bucket_MB, overlap, ...) stay
        self._kept = {k: getattr(base.parallel, k) for k in base.parallel.model_fields_set
                      if f"parallel.{k}" not in self.fields}
        self._training = base.training.model_dump(exclude_unset=True)
        self._trainings: dict[Any, TrainingSpec] = {}

    def __call__(self, cand: Candidate) -> Scenario:
        """``base`` with a candidate's settings (field checks run; cross-field ones do
        not)."""
        fields = {k: TO_FIELD[k](v) if k in TO_FIELD and is_set(v) else v
                  for k, v in zip(self.fields, cand, strict=True)}
        # a knob left at None (NaN in a table) leaves its field unset: its default
        parallel = {k.removeprefix("parallel."): v for k, v in fields.items()
                    if k.startswith("parallel.") and is_set(v)}
        par = ParallelSpec(**cast(Any, {**self._kept, **parallel}))
        micro = fields["training.micro_batch"]
        trn = self._trainings.get(micro)
        if trn is None:  # the training section reads the micro-batch alone
            trn = self._trainings[micro] = TrainingSpec(**{**self._training,
                                                           "micro_batch": micro})
        update: dict[str, Any] = {"parallel": par, "training": trn}
        options = {k.removeprefix("strategies."): v for k, v in fields.items()
                   if k.startswith("strategies.")}
        if options:
            sections: dict[str, dict[str, Any]] = {n: dict(o)
                                                   for n, o in self.base.strategies.items()}
            for key, value in options.items():
                name, _, option = key.partition(".")
                sections.setdefault(name, {})[option] = value
            update["strategies"] = sections
        return self.base.model_copy(update=update)


def candidate_scenario(base: Scenario, cand: Candidate) -> Scenario:
    """``base`` with a candidate's settings (field checks run; cross-field ones do not)."""
    return CandidateScenarios(base)(cand)
