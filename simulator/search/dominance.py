"""Which candidates the planner need not assess: those a sibling shows cannot win.

A sibling is the same candidate with one dimension's knobs at another value. Each
:class:`Rule` names a dimension, which of its values are *variants* and, for a variant,
the siblings that judge it and whether each must fit:

* **Hybrid sharding, another CP exchange** need no less memory than full sharding and
  the p2p ring (a shard group of fewer ranks holds more of each parameter; the
  all-to-all variants keep the gathered heads, allgather the gathered keys and
  values): where that sibling does not fit, neither does the variant.
* **A set of recompute modules, or torchtitan's per-op policy**, recomputes something
  and so never shortens a step: where the same layout without recomputation fits, it
  is at least as fast. Full recomputation keeps the least: where it does not fit,
  neither does a partial policy.

The MoE token dispatchers have no such order (the allgather and flex dispatchers hold
buffers the alltoall one does not, yet Mixtral's peak on 16 H100 is lowest with flex);
but no rule but the dispatcher's own reads the dispatcher, so where the alltoall
layout is invalid or not yet simulated the others are too: they are assessed only
where it is valid and simulated. ``tests/test_plan_space.py`` holds the premises to the
memory model, the estimate and the rules.

The planner assesses the candidates no rule calls a variant first, then each rule's in
:data:`RULES` order: a variant comes from the candidate with the rule's first sibling
values, which is known by then, as are its other siblings; one left out counts as not
fitting (what a later rule varies of it is left out too, by the same premises; the
dispatcher's rule comes first, so its siblings are never left out). A
sibling the search did not enumerate (a narrower request, a ``--set`` pin) decides
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from simulator.strategies.base import Dimension

Candidate = tuple[Any, ...]


#: What a sibling's verdict must be for its variants to be assessed: "fits", "does not
#: fit" (a sibling left out does not), or "runs" (valid and simulated, fitting or not)
MEETS = {"fits": lambda v: v == "fits", "does not fit": lambda v: v != "fits",
         "runs": lambda v: v in ("fits", "out of memory")}
LEFT_OUT = "left out"  # the verdict ``known`` holds for a candidate left out


@dataclass(frozen=True)
class Rule:
    """A dimension's variants and the siblings (values, what its verdict must be) that
    judge them."""

    knobs: tuple[str, ...]
    variant: Callable[[tuple[Any, ...]], bool]
    siblings: tuple[tuple[tuple[Any, ...], str], ...]
    why: str  # what a sibling's verdict shows, after "the same layout with"


RULES = (
    Rule(("dispatcher",), lambda v: v[0] not in (None, "alltoall"), ((("alltoall",), "runs"),),
         "the alltoall dispatcher is refused for a reason that is not the dispatcher's"),
    Rule(("dp_shard",), lambda v: v[0] is not None, (((None,), "fits"),),
         "full sharding does not fit (hybrid sharding needs no less memory)"),
    Rule(("cp_comm", "cp_a2a"), lambda v: v[0] not in (None, "p2p"),
         ((("p2p", None), "fits"),),
         "the p2p ring does not fit (this exchange needs no less memory)"),
    Rule(("recompute", "recompute_modules"), lambda v: v[0] == "op" or v[1] is not None,
         ((("none", None), "does not fit"), (("full", None), "fits")),
         "no recomputation fits (and is faster), or with full recomputation it does not "
         "fit (which keeps the least)"),
)


def _dimension(dims: list[Dimension], rule: Rule) -> Dimension:
    return next(d for d in dims if d.knobs == rule.knobs)


def variants(rule: Rule, known: Mapping[Candidate, str], names: tuple[str, ...],
             dims: list[Dimension], req: Any, base: Any
             ) -> tuple[list[Candidate], list[Candidate]]:
    """The variants of ``rule``, each from the candidate of ``known`` with the rule's
    first sibling values (``known``: every candidate so far, to its verdict), as those to
    assess and those left out."""
    slots = [names.index(k) for k in rule.knobs]
    dim, anchor = _dimension(dims, rule), rule.siblings[0][0]
    out: list[Candidate] = []
    left_out: list[Candidate] = []
    memo: dict[Candidate, list[tuple[Any, ...]]] = {}  # values read the earlier knobs only
    for cand in list(known):
        if tuple(cand[i] for i in slots) != anchor:
            continue
        prefix = cand[:slots[0]]
        found = memo.get(prefix)
        if found is None:
            found = memo[prefix] = [
                v for v in dim.values(req, base, dict(zip(names, cand, strict=True)))
                if rule.variant(v)]
        into = left_out if _blocked(rule, slots, cand, known) else out
        into += (_with(cand, slots, v) for v in found)
    return out, left_out


def _with(cand: Candidate, slots: list[int], values: tuple[Any, ...]) -> Candidate:
    out = list(cand)
    for slot, value in zip(slots, values, strict=True):
        out[slot] = value
    return tuple(out)


def _blocked(rule: Rule, slots: list[int], cand: Candidate,
             known: Mapping[Candidate, str]) -> bool:
    """Whether a sibling's verdict shows the variants of ``cand`` cannot win (a sibling
    not enumerated decides nothing)."""
    sibs: Iterator[tuple[Candidate, str]] = ((_with(cand, slots, v), need)
                                             for v, need in rule.siblings)
    return any(sib in known and not MEETS[need](known[sib]) for sib, need in sibs)
