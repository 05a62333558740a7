"""The planner's own dimensions: recomputation (with Megatron's modules and torchtitan's
per-op policy), hybrid sharding, the CP exchange and the MoE token dispatcher.

Each yields only values the scenario schema accepts for the knobs chosen before it,
asked of the schema's own rules on a probe (a copy of the base scenario with those
knobs): :func:`~simulator.spec.recompute.recompute_problems` and
:func:`~simulator.spec.recompute.model_problems`, the context strategy's
:func:`~simulator.strategies.context.strategy.a2a_problems`, the expert strategy's
:func:`~simulator.strategies.expert.strategy.dispatcher_problems` and the ZeRO-3
strategy's ``problems`` and ``unsupported`` (hybrid sharding). What a knob would leave
as the field's default is ``None`` (a dense model's dispatcher, CP 1's exchange, full
sharding, the default modules), so a candidate's scenario leaves that field unset.

Which values are assessed only where a sibling says they could win is
:mod:`simulator.search.dominance`'s: module sets and the per-op policy only where the
layout without recomputation does not fit and with full recomputation does; HSDP and
another CP exchange only where full sharding and the p2p ring fit; another dispatcher
only where the alltoall one is valid and simulated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from simulator.errors import Problem, UserError
from simulator.memo import by_identity
from simulator.search.choices import CP_COMM, DISPATCHERS, RECOMPUTE, SEP
from simulator.spec.base import divisor_list
from simulator.spec.recompute import model_problems, module_names, recompute_problems
from simulator.spec.scenario import ParallelSpec, Scenario
from simulator.strategies.base import Dimension
from simulator.strategies.context.strategy import a2a_problems
from simulator.strategies.expert.strategy import dispatcher_problems
from simulator.strategies.zero3.strategy import ZERO3


def modules_field(value: str | None) -> tuple[str, ...] | None:
    """The ``recompute_modules`` knob (``core_attn+mlp``) as the field holds it."""
    return None if value is None else tuple(value.split(SEP))


def modules_knob(value: Any) -> str | None:
    """The field's value (a list from ``--set``, a tuple) as the knob, modules in the
    field's order (``[core_attn]``, the default, is None)."""
    if value is None:
        return None
    modules = [m for m in module_names() if m in value]
    return None if modules == ["core_attn"] else SEP.join(modules)


def present_modules(base: Scenario) -> frozenset[str]:
    """The modules the model has: a set naming another recomputes what a smaller set
    does, the same candidate twice."""
    m = base.model
    dense = not m.is_moe or m.first_dense_layers > 0 or m.moe_layer_freq > 1
    have = {"core_attn": True, "layernorm": True, "mlp": dense, "moe": m.is_moe,
            "moe_act": m.is_moe, "shared_experts": m.is_moe and m.shared_experts > 0,
            "mla_up_proj": m.mla is not None}
    return frozenset(k for k, on in have.items() if on)


def _probe(base: Scenario, **parallel: Any) -> Scenario:
    return base.model_copy(update={"parallel": ParallelSpec(**parallel)})


def _recompute(req: Any, base: Scenario,
               chosen: Mapping[str, Any]) -> Iterator[tuple[str, str | None]]:
    """Each requested mode; selective also with each module set of the request the model
    has; what the schema's recompute rules accept."""
    have = present_modules(base)
    for mode in req.recompute:
        sets: tuple[str | None, ...] = (None,)
        if mode == "selective":
            sets += tuple(s for s in req.recompute_modules if set(s.split(SEP)) <= have)
        for modules in sets:
            par = ParallelSpec(recompute=mode, recompute_modules=modules_field(modules))
            if not recompute_problems(par) + model_problems(base.model, par, base.stack.fp8):
                yield mode, modules


def _cp_comm(req: Any, base: Scenario,
             chosen: Mapping[str, Any]) -> Iterator[tuple[str | None, int | None]]:
    """CP 1: nothing to exchange. Else each requested exchange (a2a+p2p with each
    all-to-all degree strictly between 1 and cp) the context strategy's rules accept."""
    tp, cp = chosen["tp"], chosen["cp"]
    if cp == 1:
        yield None, None
        return
    for kind in req.cp_comm:
        degrees = [a for a in divisor_list(cp) if 1 < a < cp] if kind == "a2a+p2p" else [None]
        for a in degrees:
            if not a2a_problems(_probe(base, tp=tp, cp=cp, cp_comm_type=kind, cp_a2a=a)):
                yield kind, a


def _dispatchers(req: Any, base: Scenario,
                 chosen: Mapping[str, Any]) -> Iterator[tuple[str | None]]:
    """A dense model: none. A mixture of experts: each requested dispatcher the expert
    strategy's rules accept."""
    if not base.model.is_moe:
        yield (None,)
        return
    for d in req.dispatchers:
        probe = _probe(base, tp=chosen["tp"], cp=chosen["cp"], dp=chosen["dp"],
                       ep=chosen["ep"], moe_token_dispatcher=d)
        if not dispatcher_problems(probe):
            yield (d,)


def _dp_shards(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[int | None]]:
    """Full sharding (None); under ZeRO-3 also each shard-group size the ZeRO-3
    strategy's rules accept and simulate: the request's, or by default each divisor of
    dp below it whose group (tp · cp · dp_shard GPUs) is whole nodes (worked out once per
    base scenario, request and degrees: the enumeration asks for every layout under
    ZeRO-3)."""
    yield (None,)
    if chosen["zero"] != 3:
        return
    key = (req.dp_shard, chosen["tp"], chosen["cp"], chosen["dp"], chosen.get("ep", 1))
    table: dict[tuple[Any, ...], tuple[int, ...]] = by_identity(_SHARDS, base, dict, 8)
    sizes = table.get(key)
    if sizes is None:
        sizes = table[key] = tuple(_shard_sizes(base, *key))
    yield from ((d,) for d in sizes)


_SHARDS: dict[int, tuple[Any, dict[tuple[Any, ...], tuple[int, ...]]]] = {}


def _shard_sizes(base: Scenario, asked: Any, tp: int, cp: int, dp: int,
                 ep: int) -> Iterator[int]:
    """:func:`_dp_shards`' sizes below full sharding (``asked``: the request's, or None)."""
    node = base.cluster.gpus_per_node or 1
    sizes = asked if asked is not None else \
        [d for d in divisor_list(dp) if (tp * cp * d) % node == 0]
    for d in sizes:
        if d >= dp:
            continue  # dp itself is full sharding
        probe = _probe(base, tp=tp, cp=cp, dp=dp, ep=ep, zero=3, dp_shard=d)
        if not ZERO3.problems(probe) + ZERO3.unsupported(probe):
            yield d


def _one_of(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise UserError([Problem(flag, text, f"{bad[0] if bad else 'nothing'} is not one of "
                                 f"{', '.join(allowed)}; give a comma-separated list")])
    return items


def parse_names(flag: str, text: str) -> tuple[str, ...]:
    """``--recompute``, ``--cp-comm`` or ``--moe-dispatchers``: a comma-separated list."""
    allowed = {"--recompute": RECOMPUTE, "--cp-comm": CP_COMM,
               "--moe-dispatchers": DISPATCHERS}[flag]
    return _one_of(flag, text, allowed)


def parse_module_sets(text: str) -> tuple[str, ...]:
    """``--recompute-modules core_attn+mlp,moe_act`` (sets joined by commas, modules by
    ``+``) or ``none``, each set in the field's module order."""
    if text.strip() == "none":
        return ()
    out = []
    for item in text.split(","):
        modules = _one_of("--recompute-modules", item.replace(SEP, ","), module_names())
        out.append(SEP.join(m for m in module_names() if m in modules))
    return tuple(dict.fromkeys(out))


def _micro_batches(req: Any, base: Scenario, chosen: Mapping[str, Any]) -> Iterator[tuple[int]]:
    return ((b,) for b in req.micro_batches if b * chosen["dp"] <= req.global_batch)


#: The planner's own dimensions, beside the strategies'. The recompute mode nests where
#: it always did; those added later come last, so earlier columns keep their places
#: (each reads only knobs chosen before it).
PLANNER_DIMENSIONS = (
    Dimension(("recompute", "recompute_modules"),
              ("parallel.recompute", "parallel.recompute_modules"), 80, _recompute),
    Dimension(("micro_batch",), ("training.micro_batch",), 100, _micro_batches),
    Dimension(("cp_comm", "cp_a2a"), ("parallel.cp_comm_type", "parallel.cp_a2a"), 110,
              _cp_comm),
    Dimension(("dispatcher",), ("parallel.moe_token_dispatcher",), 120, _dispatchers),
    Dimension(("dp_shard",), ("parallel.dp_shard",), 130, _dp_shards),
)

#: A knob whose table value is not the field's: knob to field, and field (as ``--set``
#: gives it) to knob
TO_FIELD = {"parallel.recompute_modules": modules_field}
TO_KNOB = {"parallel.recompute_modules": modules_knob}
