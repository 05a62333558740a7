"""Several scenarios on one cluster: each job alone, then all together, on one fabric.

Every job is simulated at full fidelity (each rank its own process, so that each
rank's flow leaves through its own leaf's uplink) on the cluster's system, at the
nodes :mod:`simulator.colocate.placement` gives it. Alone, a job has the fabric to
itself (same nodes, same fabric, no other job); together, every job runs in one SimPy
environment on one network (:func:`simulator.engine.together.run_together`). A job's
slowdown is its mean measured step time together over its mean alone: where no link
carries two jobs' flows the two runs do the same arithmetic and the slowdown is
exactly 1. A job's k-th step (measured or not) has its jitter's draws of step k, as
``clustersim run --steps``; without jitter every step is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from simulator.builder.budget import check_engine_cost
from simulator.builder.tasks import Workload
from simulator.builder.workload import build_workload
from simulator.colocate.contention import Contention
from simulator.colocate.placement import place
from simulator.engine.together import Job, Together, run_together
from simulator.errors import Problem, UserError
from simulator.spec.cluster_file import ClusterFile
from simulator.spec.load import load_scenario
from simulator.spec.rules import not_yet_simulated
from simulator.spec.scenario import Scenario
from simulator.system.fabric import Fabric, FabricShape, PlacedTopology
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system
from simulator.system.topology import LinkId


@dataclass
class ColocatedJob:
    name: str
    path: Path
    scenario: Scenario
    workload: Workload  # its first step at full fidelity
    nodes: list[int] = field(default_factory=list)
    steps: int = 1
    start_s: float = 0.0
    _later: dict[int, Workload] = field(default_factory=dict)

    def workload_of(self, step: int) -> Workload:
        """Step ``step``'s workload: the first one's, but for a jitter's own draws."""
        if step == 0 or self.scenario.variability.jitter is None:
            return self.workload
        got = self._later.get(step)
        if got is None:
            got = self._later[step] = build_workload(self.scenario, fidelity="full",
                                                     step=step)
        return got


@dataclass
class Colocation:
    """What ``clustersim colocate`` reports: the cluster, its jobs, each run."""

    spec: ClusterFile
    shape: FabricShape
    jobs: list[ColocatedJob]
    alone: list[Together]  # each job's own run
    together: Together
    contention: Contention


def cluster_system(spec: ClusterFile, base: Path) -> tuple[str, HardwareProfile]:
    """The cluster's system as a job's ``cluster.system`` names it, and its profile."""
    system = spec.system
    if system.lower().endswith((".yaml", ".yml")) and not Path(system).is_absolute():
        system = str((base / system).resolve())
    try:
        return system, load_system(system)
    except UserError as exc:
        raise UserError([Problem("system", spec.system, str(p).split(": ", 1)[-1])
                         for p in exc.problems]) from None


def load_job(spec: ClusterFile, base: Path, i: int, system: str) -> ColocatedJob:
    """Job ``i``'s scenario on the cluster's system, at full fidelity."""
    job = spec.jobs[i]
    path = base / job.scenario
    if not path.is_file():
        raise UserError([Problem(f"jobs[{i}].scenario", job.scenario,
                                 f"no such file ({path}); give a scenario YAML, its path "
                                 "relative to the cluster file")])
    try:
        s = load_scenario(path, [f"cluster.system={system}", "simulation.method=engine",
                                 "simulation.fidelity=full"])
    except UserError as exc:
        raise UserError([f"jobs[{i}] ({job.scenario}): {line}" for line in exc.lines()]) \
            from None
    where = f"jobs[{i}] ({job.scenario}): cluster."
    if s.cluster.oversubscription is not None:
        raise UserError([Problem(where + "oversubscription", s.cluster.oversubscription,
                                 "the cluster file's fabric.oversubscription sets the "
                                 "shared fabric's; remove it from the scenario")])
    problem = not_yet_simulated(s)
    if problem:
        raise UserError([f"jobs[{i}] ({job.scenario}): {line}" for line in problem])
    check_engine_cost(s, "full")
    return ColocatedJob(job.name or s.name, path, s, build_workload(s, fidelity="full"),
                        steps=job.steps, start_s=job.start_s)


def load_jobs(spec: ClusterFile, base: Path) -> tuple[FabricShape, list[ColocatedJob]]:
    system, hw = cluster_system(spec, base)
    jobs = [load_job(spec, base, i, system) for i in range(len(spec.jobs))]
    named = [job.name for job in spec.jobs if job.name is not None]
    dup = next((n for n in named if named.count(n) > 1), None)
    if dup is not None:
        raise UserError([Problem("jobs", dup, "two jobs have this name; give each a name "
                                 "of its own (jobs[i].name)")])
    for i, j in enumerate(jobs):  # a scenario's name taken twice: the job's index after it
        if spec.jobs[i].name is None and [x.name for x in jobs].count(j.name) > 1:
            j.name = f"{j.name}-{i}"
    names = [j.name for j in jobs]
    if hw.domain_gpus > hw.gpus_per_node:
        raise UserError([Problem("system", spec.system, f"its NVLink domains join "
                                 f"{hw.domain_gpus // hw.gpus_per_node} nodes; colocate "
                                 "places jobs by node on a network of nodes: use a system "
                                 "whose NVLink domain is one node")])
    for i, j in enumerate(jobs):
        gpn = j.scenario.cluster.gpus_per_node
        if gpn is not None and gpn > hw.gpus_per_node:
            raise UserError([Problem(f"jobs[{i}] ({spec.jobs[i].scenario}): "
                                     "cluster.gpus_per_node", gpn, f"{spec.system} has "
                                     f"{hw.gpus_per_node} GPUs per node; use at most that")])
    nodes = place(spec, [j.scenario.cluster.nodes for j in jobs], names)
    for j, mine in zip(jobs, nodes, strict=True):
        j.nodes = mine
    over = spec.fabric.oversubscription
    shape = FabricShape(spec.nodes, hw.gpus_per_node, spec.fabric.nodes_per_leaf,
                        hw.inter_node.oversubscription if over is None else over,
                        hw.inter_node.bytes_per_s)
    return shape, jobs


def _run(shape: FabricShape, jobs: list[ColocatedJob], starts: list[float],
         steps: list[int], indices: list[int]) -> tuple[Together, Contention]:
    """Jobs ``indices`` side by side on a fabric of their own."""
    fabric = Fabric(shape)
    engine_jobs = []
    for i in indices:
        j = jobs[i]
        topo = PlacedTopology(j.workload.layout, j.scenario.hardware, fabric, j.nodes, i,
                              j.workload.link_factors)
        engine_jobs.append(Job(j.workload_of, j.scenario.hardware, topo, steps[i],
                               starts[i]))
    watch = Contention(fabric.job_of)
    return run_together(engine_jobs, fabric.capacity, fabric.shared, watch), watch


def colocate(spec: ClusterFile, base: Path,
             progress: Callable[[str], None] | None = None) -> Colocation:
    """Place the jobs, run each alone and all together (``progress`` hears of it once the
    file and its scenarios are read)."""
    shape, jobs = load_jobs(spec, base)
    if progress is not None:
        progress(f"simulating {len(jobs)} job(s) alone and together ...")
    steps = [j.steps for j in jobs]
    if any(job.phase is not None for job in spec.jobs):  # a phase is of the step alone
        once = [1] * len(jobs)
        for i, job in enumerate(spec.jobs):
            if job.phase is not None:
                first, _ = _run(shape, jobs, [0.0] * len(jobs), once, [i])
                jobs[i].start_s = job.phase * first.steps[0].times[0]
    starts = [j.start_s for j in jobs]
    alone = [_run(shape, jobs, starts, steps, [i])[0] for i in range(len(jobs))]
    together, watch = _run(shape, jobs, starts, steps, list(range(len(jobs))))
    return Colocation(spec, shape, jobs, alone, together, watch)


def uplinks(c: Colocation) -> list[LinkId]:
    """The shared links any run's flows crossed, in order."""
    seen = set(c.together.busy) | {link for run in c.alone for link in run.busy}
    return sorted((link for link in seen if link[0] == "up"),
                  key=lambda link: tuple(int(str(x)) for x in link[1:]))
