"""The cluster file: several scenarios placed on one shared cluster (``clustersim
colocate``).

A cluster is ``nodes`` nodes of one ``system`` (a preset name or a hardware-profile
YAML) under one fabric: leaf groups of ``fabric.nodes_per_leaf`` nodes whose uplinks
are tapered by ``fabric.oversubscription`` (:mod:`simulator.system.fabric`). Each job
names a scenario file (relative to the cluster file), how many steps to measure and
when it starts; it gets whole nodes, either listed (``nodes: [0, 2, "4-7"]``: node
numbers and inclusive ranges, in the order the job's own nodes take them) or chosen by
the cluster's ``placement`` policy among the nodes no job lists
(:mod:`simulator.colocate.placement`). Every job runs on the cluster's system: its
scenario's ``cluster.system`` is replaced, its ``cluster.nodes`` is how many nodes it
gets.

Reading gives a :class:`ClusterFile` or a one-line :class:`~simulator.errors.UserError`
per problem, naming the field, the value and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from simulator.errors import Problem, UserError
from simulator.loading import read_yaml
from simulator.spec.base import MAX_SIZE, Frozen
from simulator.spec.problems import problem_of

Policy = Literal["packed", "spread", "interleaved"]
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
MAX_STEPS = 1000


class FabricSpec(Frozen):
    # nodes under one leaf group (one leaf switch per rail); NVIDIA's DGX SuperPOD
    # reference architecture builds scalable units of 32 DGX H100 nodes
    nodes_per_leaf: int = Field(default=32, gt=0, le=MAX_SIZE)
    # leaf uplinks' taper (bandwidth into a leaf / out of it); absent = the system's
    # inter_node.oversubscription
    oversubscription: float | None = Field(default=None, ge=1, le=1e4)


class JobSpec(Frozen):
    scenario: str = Field(min_length=1, max_length=4096)  # scenario YAML, relative to this file
    name: str | None = Field(default=None, min_length=1, max_length=200)  # default: scenario's
    # the cluster's nodes this job holds, in the order of the job's own nodes: numbers and
    # inclusive ranges ("4-7"); absent = the cluster's placement policy chooses
    nodes: list[int | str] | None = Field(default=None, max_length=MAX_SIZE)
    steps: int = Field(default=3, gt=0, le=MAX_STEPS)  # measured steps
    start_s: float = Field(default=0.0, ge=0, le=1e9)  # when its first step starts, seconds
    # or: when it starts as a fraction of its own step time alone (its phase)
    phase: float | None = Field(default=None, ge=0, lt=1)

    @field_validator("nodes")
    @classmethod
    def _node_refs(cls, refs: list[int | str] | None) -> list[int | str] | None:
        for ref in refs or ():
            if isinstance(ref, bool) or (isinstance(ref, int) and ref < 0) or (
                    isinstance(ref, str) and not _RANGE.match(ref)):
                raise ValueError(f"{ref!r} is not a node number or a range like \"4-7\"")
        return refs

    @model_validator(mode="after")
    def _one_start(self) -> JobSpec:
        if self.phase is not None and self.start_s > 0:
            raise ValueError("give start_s or phase, not both")
        return self

    def node_list(self) -> list[int] | None:
        """The listed nodes, ranges expanded (None: the policy places the job)."""
        if self.nodes is None:
            return None
        out: list[int] = []
        for ref in self.nodes:
            if isinstance(ref, int):
                out.append(ref)
                continue
            m = _RANGE.match(ref)
            assert m is not None  # checked by the validator
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise UserError([Problem("nodes", ref, "a range runs low-high, e.g. \"4-7\"")])
            if hi - lo >= MAX_SIZE:
                raise UserError([Problem("nodes", ref, f"spans more than {MAX_SIZE} nodes")])
            out.extend(range(lo, hi + 1))
        return out


class ClusterFile(Frozen):
    name: str = Field(min_length=1, max_length=200)
    description: str = Field(default="", max_length=10_000)
    system: str = Field(min_length=1, max_length=4096)  # preset name or hardware-profile YAML
    nodes: int = Field(gt=0, le=MAX_SIZE)  # nodes in the cluster
    fabric: FabricSpec = FabricSpec()
    # how jobs without a node list are placed, among the nodes no job lists: packed
    # (consecutive nodes, job after job), spread (each job over as many leaves as it
    # can), interleaved (node by node, job by job)
    placement: Policy = "packed"
    jobs: list[JobSpec] = Field(min_length=1, max_length=1000)


def with_options(spec: ClusterFile, placement: str | None = None,
                 oversubscription: float | None = None, steps: int | None = None
                 ) -> ClusterFile:
    """The file with the command line's choices in place of its own, validated again."""
    data = spec.model_dump()
    if placement is not None:
        data["placement"] = placement
    if oversubscription is not None:
        data["fabric"]["oversubscription"] = oversubscription
    if steps is not None:
        for job in data["jobs"]:
            job["steps"] = steps
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as exc:
        flags = {"placement": "--placement", "fabric": "--oversubscription",
                 "jobs": "--steps"}
        err = exc.errors()[0]
        problem = problem_of(err, root=ClusterFile)
        raise UserError([Problem(flags.get(str(err["loc"][0]), problem.field), problem.value,
                                 problem.fix)]) from None


def load_cluster_file(path: Path) -> tuple[ClusterFile, Path]:
    """The cluster file and the directory its relative paths start from."""
    data = read_yaml(path, "cluster file")
    if not isinstance(data, dict):
        raise UserError([Problem("cluster file", str(path), "must be a YAML mapping with "
                                 "keys name, system, nodes, jobs")])
    if "model" in data and "jobs" not in data:
        raise UserError([Problem("cluster file", str(path), "is a scenario (it has model); "
                                 "a cluster file names system, nodes and jobs, each job a "
                                 "scenario (docs/colocate.md)")])
    try:
        spec = ClusterFile.model_validate(data, strict=True)
    except ValidationError as exc:
        raise UserError([problem_of(err, root=ClusterFile) for err in exc.errors()]) from None
    return spec, path.parent
