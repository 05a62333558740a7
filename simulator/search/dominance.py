"""Which candidates the planner need not assess: those a sibling shows cannot win.

A sibling is the same candidate with one dimension's knobs at another value. Each
:class:`Rule` names a dimension, which of its values are *variants* and, for a variant,
the siblings it is judged by and whether each must fit:

* **HSDP, another CP exchange, another MoE dispatcher** need no less memory than full
  sharding, the p2p ring and the alltoall dispatcher (a shard group of fewer ranks
  holds more of each parameter; the all-to-all variants keep the gathered heads and
  allgather the gathered keys and values; the allgather and flex dispatchers hold
  buffers the alltoall one does not): where that sibling does not fit, neither does
  the variant.
* **A set of recompute modules, or torchtitan's per-op policy**, recomputes something
  and so never shortens a step: where the same layout without recomputation fits, it
  is at least as fast. Full recomputation keeps the least: where it does not fit,
  neither does a partial policy.

``tests/test_plan_space.py`` holds both premises to the memory model and the estimate.
Candidates are assessed in rounds, one per rule in :data:`RULES` order after those with
no variant at all: a candidate's round is that of the last rule it is a variant of, and
its siblings under that rule are variants of earlier rules only, so their verdicts are
known (a sibling itself skipped does not fit). A sibling the search did not enumerate
(a narrower request, a ``--set`` pin) decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from simulator.strategies.base import Dimension

Candidate = tuple[Any, ...]


@dataclass(frozen=True)
class Rule:
    """A dimension's variants and the siblings (values, must fit) that judge them."""

    knobs: tuple[str, ...]
    variant: Callable[[tuple[Any, ...]], bool]
    siblings: tuple[tuple[tuple[Any, ...], bool], ...]
    why: str  # what a sibling's verdict shows, after "the same layout with"


RULES = (
    Rule(("dp_shard",), lambda v: v[0] is not None, (((None,), True),),
         "full sharding does not fit (hybrid sharding needs no less memory)"),
    Rule(("cp_comm", "cp_a2a"), lambda v: v[0] not in (None, "p2p"), ((("p2p", None), True),),
         "the p2p ring does not fit (this exchange needs no less memory)"),
    Rule(("dispatcher",), lambda v: v[0] not in (None, "alltoall"), ((("alltoall",), True),),
         "the alltoall dispatcher does not fit (this one needs no less memory)"),
    Rule(("recompute", "recompute_modules"), lambda v: v[0] == "op" or v[1] is not None,
         ((("none", None), False), (("full", None), True)),
         "no recomputation fits (and is faster), or with full recomputation it does not "
         "fit (which keeps the least)"),
)


def _dimension(dims: list[Dimension], rule: Rule) -> Dimension:
    return next(d for d in dims if d.knobs == rule.knobs)


def variants(rule: Rule, known: Mapping[Candidate, bool], names: tuple[str, ...],
             dims: list[Dimension], req: Any, base: Any) -> tuple[list[Candidate], int]:
    """The variants of ``rule`` that could win, each from the candidate ``known`` holds
    with the rule's first sibling values (``known``: candidate to whether it fits, every
    one enumerated so far), and how many were left out."""
    slots = [names.index(k) for k in rule.knobs]
    dim, anchor = _dimension(dims, rule), rule.siblings[0][0]
    out: list[Candidate] = []
    skipped = 0
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
        if _blocked(rule, slots, cand, known):
            skipped += len(found)
        else:
            out += (_with(cand, slots, v) for v in found)
    return out, skipped


def _with(cand: Candidate, slots: list[int], values: tuple[Any, ...]) -> Candidate:
    out = list(cand)
    for slot, value in zip(slots, values, strict=True):
        out[slot] = value
    return tuple(out)


def _blocked(rule: Rule, slots: list[int], cand: Candidate,
             known: Mapping[Candidate, bool]) -> bool:
    """Whether a sibling's verdict shows the variants of ``cand`` cannot win (a sibling
    not enumerated decides nothing)."""
    sibs: Iterator[tuple[Candidate, bool]] = ((_with(cand, slots, v), must)
                                              for v, must in rule.siblings)
    return any(sib in known and known[sib] != must for sib, must in sibs)
