"""Variability: slow GPUs, degraded links and per-kernel jitter, and the folding that
survives them.

**The section.** A scenario's ``variability:`` names ranks whose compute is slower
(``slow_gpus``: listed ranks, or ``random: k`` of them drawn with the seed), links
at a fraction of their bandwidth (``slow_links``: a rank's NVLink port or its NIC)
and per-task jitter (``jitter``: every compute task's duration times a factor of
mean 1, lognormal of a given σ or drawn from measured samples). Everything is
seeded (``seed``); a step is deterministic for a given seed and step index.

**Attributes.** :func:`resolve` turns the section into per-rank attributes: a
compute factor and, per link class, a bandwidth factor. The builder multiplies a
slow rank's compute durations, the topology scales its link's capacity.

**Folding by classes.** Symmetric folding simulates one rank per stage and lets it
stand for every (dp, tp) peer: any permutation of data-parallel replicas and of
tensor-parallel indices maps the cluster onto itself. An asymmetric rank breaks
only the permutations that move it. :func:`classes` splits each stage's ranks by
the data-parallel replica (kept apart when it holds an asymmetric rank, else
"clean") times the tensor-parallel index (kept apart when an asymmetric rank
has it, else "clean"): two ranks of one class are swapped by a permutation that
fixes every asymmetric rank, so their timelines are identical. Each class is
simulated by its lowest rank, which stands for the class's size on shared links.
Because classes are a product of a replica class and an index class, the
representatives of every class a group touches sit in one group, the one of the
representative's own: the engine's rendezvous over simulated members stays
exact. The TP index is split only on the stages where it can matter
(:func:`odd_tp_indices`): a stage sends to the next only after a TP collective,
which every TP rank leaves together, so an asymmetric rank's index is odd on its
own stage and its neighbours (which receive from it) only; where the backward runs
every TP collective beside the compute (Megatron's async backward without sequence
parallelism, TE's pipelined overlap) nothing re-synchronises it and the index is odd on
every stage. A rank whose sender
is not simulated receives from the clean index's representative
(:func:`clean_tp_index`). One slow GPU thus adds one class per stage (its
replica) and two more on its stage and its neighbours (on every stage where nothing
re-synchronises), never a fall back to full
fidelity; tests check folded against full to 1e-9. Expert parallelism splits a
replica index into (expert-data index, position in the EP group), each split on
its own (:func:`replica_classes`); experts with a TP degree of their own regrid a
stage in a way that does not factor, and such a run simulates every rank. Jitter is drawn per
simulated rank: in folded mode a class's members move together (the max over
many independently jittered ranks needs ``--fidelity full``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from simulator.errors import Problem, UserError
from simulator.system.layout import Layout
from simulator.system.profiles import load_system

if TYPE_CHECKING:  # numpy only where draws are made: loading a scenario stays light
    import numpy as np

LinkClass = Literal["intra_node", "inter_node"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False,
                              use_attribute_docstrings=True)


class SlowGPUs(_Frozen):
    """Ranks whose compute takes ``compute_slowdown`` times as long (1.25: 0.8× speed)."""

    ranks: list[int] | None = None
    """These ranks are slow (give either ranks or random)."""
    random: int | None = Field(default=None, gt=0, le=10**7)
    """This many ranks, drawn with ``variability.seed``, are slow."""
    compute_slowdown: float = Field(ge=1e-3, le=1000)
    """Factor on every compute duration of those ranks (1.25 = 0.8× speed)."""


class SlowLink(_Frozen):
    """One rank's port of a link class at a fraction of its bandwidth."""

    rank: int = Field(ge=0, le=10**9)
    """The rank whose port is degraded."""
    link: LinkClass
    """Which port: intra_node (its NVLink/NVSwitch port) or inter_node (its NIC)."""
    bandwidth_factor: float = Field(ge=1e-6, le=1)
    """Fraction of the port's bandwidth left (0.5 = half)."""


class JitterSpec(_Frozen):
    """Per-task compute jitter: duration × a factor of mean 1."""

    distribution: Literal["lognormal", "empirical"] = "lognormal"
    """lognormal (of ``sigma``) or empirical (drawn from ``samples``)."""
    sigma: float = Field(default=0.05, ge=0, le=2)
    """lognormal: σ of log(factor), dimensionless."""
    samples: list[float] = []
    """empirical: measured durations (any unit; rescaled to mean 1)."""


class StageSystem(_Frozen):
    """Pipeline stages that run on another system (a mixed-generation cluster)."""

    stages: list[int] = Field(min_length=1)
    """Pipeline stages (0-based) on this system."""
    system: str = Field(min_length=1, max_length=4096)
    """A system preset name or the path of a hardware-profile YAML."""


class VariabilitySpec(_Frozen):
    """Stragglers, degraded links and jitter (all optional); seeded."""

    slow_gpus: list[SlowGPUs] = []
    """Ranks whose compute is slower."""
    slow_links: list[SlowLink] = []
    """Ranks whose NVLink port or NIC runs at a fraction of its bandwidth."""
    jitter: JitterSpec | None = None
    """Per-task compute jitter; none by default."""
    stage_systems: list[StageSystem] = []
    """Pipeline stages on another system (a mixed-generation cluster)."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seed of the random ranks and of the jitter draws."""

    @property
    def active(self) -> bool:
        """Anything that makes ranks of one stage differ (stage systems do not)."""
        return bool(self.slow_gpus or self.slow_links or self.jitter is not None)


def variability_problems(v: VariabilitySpec, world: int, pp: int = 1) -> list[Problem]:
    """Ranks that do not exist, a slow-GPU entry naming both or neither of ranks and
    random, an empirical jitter without samples, stages that do not exist or are
    given two systems, a system that does not load."""
    out: list[Problem] = []
    seen: set[int] = set()
    for i, entry in enumerate(v.stage_systems):
        where = f"variability.stage_systems[{i}]"
        for st in entry.stages:
            if not 0 <= st < pp:
                out.append(Problem(f"{where}.stages", st, f"no such stage; stages are 0..{pp - 1}"))
            elif st in seen:
                out.append(Problem(f"{where}.stages", st, "already given a system; name each "
                                   "stage once"))
            seen.add(st)
        try:
            load_system(entry.system)
        except UserError as exc:
            first = exc.problems[0] if exc.problems else "not a system"
            fix = first.fix if isinstance(first, Problem) else first
            out.append(Problem(f"{where}.system", entry.system, fix))
    for i, g in enumerate(v.slow_gpus):
        where = f"variability.slow_gpus[{i}]"
        if (g.ranks is None) == (g.random is None):
            out.append(Problem(where, g.model_dump(exclude_none=True),
                               "give either ranks: [..] or random: k"))
        for r in g.ranks or ():
            if not 0 <= r < world:
                out.append(Problem(f"{where}.ranks", r, f"no such rank; ranks are 0..{world - 1}"))
        if g.random is not None and g.random > world:
            out.append(Problem(f"{where}.random", g.random, f"more than the {world} GPUs"))
    for i, link in enumerate(v.slow_links):
        if link.rank >= world:
            out.append(Problem(f"variability.slow_links[{i}].rank", link.rank,
                               f"no such rank; ranks are 0..{world - 1}"))
    j = v.jitter
    if j is not None and j.distribution == "empirical":
        if not j.samples or min(j.samples) <= 0:
            out.append(Problem("variability.jitter.samples", list(j.samples),
                               "an empirical jitter needs positive measured durations"))
    elif j is not None and j.samples:
        out.append(Problem("variability.jitter.samples", list(j.samples),
                           "samples are for distribution: empirical; drop them or switch"))
    return out


@dataclass(frozen=True)
class Attributes:
    """Per-rank departures from the system profile (ranks not named are nominal)."""

    compute: Mapping[int, float]  # rank -> duration factor
    links: Mapping[tuple[int, str], float]  # (rank, link class) -> bandwidth factor

    @property
    def asymmetric(self) -> frozenset[int]:
        return frozenset(self.compute) | frozenset(r for r, _ in self.links)


NOMINAL = Attributes({}, {})


def resolve(v: VariabilitySpec, world: int) -> Attributes:
    """The section as per-rank factors. Factors of one rank named twice multiply; a
    ``random`` entry draws its ranks without replacement from the seed."""
    import numpy as np

    rng = np.random.default_rng([v.seed, 0])
    compute: dict[int, float] = {}
    for g in v.slow_gpus:
        ranks = g.ranks if g.ranks is not None else _draw(rng, world, g.random or 0)
        for r in ranks:
            compute[r] = compute.get(r, 1.0) * g.compute_slowdown
    links: dict[tuple[int, str], float] = {}
    for link in v.slow_links:
        key = (link.rank, link.link)
        links[key] = links.get(key, 1.0) * link.bandwidth_factor
    return Attributes({r: f for r, f in compute.items() if f != 1.0},
                      {k: f for k, f in links.items() if f != 1.0})


def _draw(rng: np.random.Generator, world: int, k: int) -> tuple[int, ...]:
    """``k`` distinct ranks of ``world``, in draw order, without a world-sized array."""
    if 2 * k > world:
        return tuple(int(r) for r in rng.permutation(world)[:k])
    seen: dict[int, None] = {}
    while len(seen) < k:
        seen.setdefault(int(rng.integers(world)), None)
    return tuple(seen)


def odd_tp_indices(layout: Layout, attrs: Attributes,
                   resync: bool = True) -> dict[int, set[int]]:
    """Per stage, the TP indices whose ranks may differ from their TP peers there: an
    asymmetric rank's, on its own stage and on the neighbouring ones. Its TP peers
    leave every TP collective with it, and a stage sends only after one, but its
    port carries its data-parallel flows at other times than theirs, so what it
    sends (or receives over a degraded port) can arrive at another time; two stages
    away the difference is gone (every TP group re-synchronises first). The first
    and last stage split alike: they meet in the tied embedding's all-reduce.
    ``resync`` False: the backward's TP collectives all run beside the compute (a
    side collective ends together, the compute beside it does not), so nothing
    re-synchronises a TP group there and the index is odd on every stage."""
    odd: dict[int, set[int]] = {p: set() for p in range(layout.pp)}
    for r in attrs.asymmetric:
        c = layout.coord(r)
        near = (c.pp - 1, c.pp, c.pp + 1) if resync else range(layout.pp)
        for p in near:
            odd[p % layout.pp].add(c.tp)
    # the first and last stage share a group (the tied embedding's all-reduce)
    ends = odd[0] | odd[layout.pp - 1]
    odd[0], odd[layout.pp - 1] = ends, set(ends)
    return odd


def clean_tp_index(layout: Layout, attrs: Attributes, resync: bool = True) -> int | None:
    """The TP index that stands for the clean indices on every stage (the lowest one no
    stage finds odd), or None when every index is odd somewhere."""
    odd = set().union(*odd_tp_indices(layout, attrs, resync).values())
    return next((t for t in range(layout.tp) if t not in odd), None)


def _axis_classes(n: int, odd: set[int]) -> list[tuple[int, int]]:
    """(lowest index, size) of each class of ``range(n)``: each odd index alone, the
    rest together."""
    odd = {i for i in odd if 0 <= i < n}
    lowest = next((i for i in range(n) if i not in odd), None)  # <= len(odd) + 1 tries
    clean = [] if lowest is None else [(lowest, n - len(odd))]  # never lists range(n)
    return [(i, 1) for i in sorted(odd)] + clean


def replica_classes(layout: Layout, attrs: Attributes, ep: int = 1) -> list[tuple[int, int]]:
    """(lowest replica, size) of each class of data-parallel replicas. With expert
    parallelism (ep > 1, experts split as the dense TP) a replica index is (expert-data
    index, position in its EP group), and each coordinate is split on its own."""
    odd = {layout.coord(r).dp for r in attrs.asymmetric}
    if ep <= 1:
        return _axis_classes(layout.dp, odd)
    outer = _axis_classes(layout.dp // ep, {d // ep for d in odd})
    inner = _axis_classes(ep, {d % ep for d in odd})
    return [(a * ep + j, na * nj) for a, na in outer for j, nj in inner]


def classes(layout: Layout, attrs: Attributes, ep: int = 1,
            resync: bool = True) -> dict[int, int]:
    """Representative rank -> how many ranks its class holds (see the module notes);
    ``ep``: the expert-parallel degree when the experts' TP is the dense TP; ``resync``:
    whether a TP collective on the compute stream re-synchronises each backward block
    (:func:`odd_tp_indices`). Context-parallel peers are folded only when the cluster is
    symmetric (callers keep every rank otherwise)."""
    dp_classes = replica_classes(layout, attrs, ep)
    odd_tp = odd_tp_indices(layout, attrs, resync)
    clean = clean_tp_index(layout, attrs, resync)
    if clean is None:  # no common stand-in: split every stage alike
        every = set().union(*odd_tp.values())
        odd_tp = dict.fromkeys(odd_tp, every)
    out: dict[int, int] = {}
    for p in range(layout.pp):
        n_clean = layout.tp - len(odd_tp[p])
        tp_classes = [(t, 1) for t in sorted(odd_tp[p])] + \
            ([(clean, n_clean)] if n_clean and clean is not None else [])
        for d, nd in dp_classes:
            for t, nt in tp_classes:
                out[layout.rank(p, d, t)] = nd * nt * layout.cp  # CP peers alike
    return dict(sorted(out.items()))


def jitter_factors(spec: JitterSpec, seed: int, step: int, rank: int, n: int) -> np.ndarray:
    """``n`` duration factors of mean 1 for ``rank``'s compute tasks in ``step``: the
    same rank, seed and step give the same draws in any fidelity."""
    import numpy as np

    rng = np.random.default_rng([seed, 1, step, rank])
    if spec.distribution == "lognormal":
        return np.asarray(rng.lognormal(-spec.sigma ** 2 / 2, spec.sigma, n))
    samples = np.asarray(spec.samples, float)
    return np.asarray(rng.choice(samples / samples.mean(), n))
