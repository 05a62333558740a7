"""The numbers a long run is made of: failure rates, checkpoint cost, the interval.

Failures. A synchronous training job stops whenever any of its components fails,
so the job's interruption rate is the sum over component classes of (components
in the cluster) / (hours between failures of one). The classes and what each
scales with: ``gpu`` per GPU; ``host`` per node; ``nic`` per NIC; ``switch`` per
NIC link (the cable and the switch ports each link needs, so the fabric grows
with the NICs); ``software`` per node (one process group per host can hang or
crash); ``planned`` interruptions per node (upgrades; the job checkpoints first and
loses no work). Rates come from the scenario's ``reliability:`` section, or its
preset: the Llama 3 report's 419 unexpected and 47 planned interruptions in 54
days on 16,384 H100 (``presets/reliability/llama3.yaml``, with the table it
comes from), divided by that cluster's component-hours. Interruptions are a
Poisson process (exponential times between them), as in Young's and Daly's
derivations.

Checkpoints. A checkpoint holds the unique model states: the weights and the optimizer
states (master weights, Adam moments) of every parameter once, in the widths the stack
keeps them (16-bit weights and 12 bytes of fp32 states by default; fp32 weights that are
their own master copy under autocast; BF16 moments where the stack says so),
with the copy of a tied embedding that the last pipeline stage keeps — the
memory model's per-rank states summed over ranks, replicas counted once
(:func:`simulator.model.memory.stage_params`,
:func:`~simulator.model.memory.state_bytes_per_param`).
Gradients are not saved. Every rank writes an equal share (distributed
checkpointing deduplicates replicated tensors), so a synchronous write takes
size / storage bandwidth, and an asynchronous one blocks training only for the
copy of a rank's share to host memory over PCIe.

Interval. Young (1974): τ = √(2δM); Daly (2006, first order): τ = √(2δM) − δ for
δ < 2M, else M; δ is the checkpoint's cost on the critical path and M the job's
mean time between failures. A failure then loses τ/2 of work on average, plus
the restart and the reload (docs/model.md, "The job over days").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, get_args

from simulator.errors import Problem, UserError
from simulator.loading import PRESETS_DIR, read_yaml
from simulator.model.inventory.ops import dtype_bytes
from simulator.model.memory import stage_params, state_bytes_per_param
from simulator.schedules.registry import schedule_spec
from simulator.spec.placement import head_rank, stage_ends, stage_layers
from simulator.spec.scenario import Scenario

Component = Literal["gpu", "host", "nic", "switch", "software"]
COMPONENTS: tuple[Component, ...] = get_args(Component)
RELIABILITY_DIR = PRESETS_DIR / "reliability"
HOURS_PER_DAY = 24.0


@dataclass(frozen=True)
class JobRates:
    """Interruptions per hour of the whole job."""

    failures_per_h: dict[Component, float]  # unexpected, by component class
    planned_per_h: float  # planned: checkpoint, restart, no work lost
    counts: dict[Component, int]  # components of each class in the cluster

    @property
    def failure_rate_per_h(self) -> float:
        return sum(self.failures_per_h.values())

    @property
    def mtbf_h(self) -> float:
        """Mean hours between unexpected interruptions of the job (inf without any)."""
        rate = self.failure_rate_per_h
        return 1.0 / rate if rate > 0 else math.inf


def component_counts(s: Scenario) -> dict[Component, int]:
    nodes = s.cluster.nodes
    nics = nodes * s.hardware.inter_node.nics_per_node
    return {"gpu": s.parallel.world, "host": nodes, "nic": nics, "switch": nics,
            "software": nodes}


@lru_cache(maxsize=8)
def preset_mtbf_h(name: str) -> tuple[dict[Component, float], float]:
    """(hours between failures of one component by class, of planned stops per host)
    from a bundled reliability preset: its component-hours over its interruptions."""
    data: dict[str, Any] = read_yaml(RELIABILITY_DIR / f"{name}.yaml", "reliability.preset")
    hours = data["days"] * HOURS_PER_DAY
    exposure = {"gpu": data["gpus"], "host": data["hosts"], "nic": data["nics"],
                "switch": data["nics"], "software": data["hosts"]}
    counts = dict.fromkeys(COMPONENTS, 0)
    for row in data["causes"]:
        counts[row["component"]] += row["count"]
    mtbf = {c: hours * exposure[c] / n if n else math.inf for c, n in counts.items()}
    return mtbf, hours * data["hosts"] / data["planned"]


def job_rates(s: Scenario) -> JobRates:
    """The scenario's interruption rates: its fields, else its preset's, scaled."""
    rel = s.reliability
    if rel.preset == "none":
        base: dict[Component, float] = dict.fromkeys(COMPONENTS, math.inf)
        planned_base = math.inf
    else:
        base, planned_base = preset_mtbf_h(rel.preset)
        base = dict(base)
    given = {"gpu": rel.gpu_mtbf_h, "host": rel.host_mtbf_h, "nic": rel.nic_mtbf_h,
             "switch": rel.switch_mtbf_h, "software": rel.software_mtbf_h}
    counts = component_counts(s)
    per_h: dict[Component, float] = {}
    for c in COMPONENTS:
        own = given[c]
        per_h[c] = counts[c] / (own if own is not None else base[c])
    planned = rel.planned_mtbf_h if rel.planned_mtbf_h is not None else planned_base
    return JobRates(per_h, counts["host"] / planned, counts)


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointCost:
    bytes: float  # unique weights and optimizer states
    blocking_s: float  # training stalls this long per checkpoint (δ)
    durable_s: float  # from the checkpoint's start until it is safe on storage
    reload_s: float  # reading it back after a restart


def checkpoint_bytes(s: Scenario) -> float:
    """Unique model states: Σ over stages of parameters × (weight + optimizer bytes), each
    in the widths the memory model gives the stack (fp32 parameters under autocast, the
    master copy's and the moments' dtypes: ``stack.optimizer_bytes``)."""
    width = dtype_bytes(s.training.dtype)
    w, _, o = state_bytes_per_param(0, 1, s.training.dtype, fp32_params=s.stack.fp32_params(width),
                                    optimizer_bytes=s.stack.optimizer_bytes(width))
    par = s.parallel
    spec = s.model
    params = sum(stage_params(spec, par.pp, st, stage_layers(spec.layers, par, st, spec.mtp_layers),
                              head_rank(par), stage_ends(par, st))
                 for st in range(par.pp))
    return params / schedule_spec(par.schedule).directions * (w + o)  # DualPipe: 2 copies


def checkpoint_cost(s: Scenario) -> CheckpointCost:
    ck = s.checkpoint
    size = checkpoint_bytes(s)
    write = size / (ck.storage_write_GBps * 1e9)
    read = size / ((ck.storage_read_GBps or ck.storage_write_GBps) * 1e9)
    if ck.asynchronous:
        snapshot = size / s.parallel.world / (s.hardware.host.pcie_bandwidth_GBps * 1e9)
        return CheckpointCost(size, snapshot, snapshot + write, read)
    return CheckpointCost(size, write, write, read)


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young (1974): τ = √(2δM), seconds of work between checkpoints."""
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly (2006), first order: τ = √(2δM) − δ for δ < 2M, else M."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    return young_interval(delta_s, mtbf_s) - delta_s


# ---------------------------------------------------------------- energy


def power_W(s: Scenario) -> tuple[float, float]:
    """(GPU board power, node power without GPUs) in W: the cost section, else the system."""
    sys_power = s.hardware.power
    gpu = s.cost.gpu_power_W if s.cost.gpu_power_W is not None else (
        sys_power.gpu_W if sys_power else None)
    host = s.cost.host_power_W if s.cost.host_power_W is not None else (
        sys_power.host_W if sys_power else None)
    if gpu is None or host is None:
        field = "cost.gpu_power_W" if gpu is None else "cost.host_power_W"
        raise UserError([Problem(field, None, f"system {s.hardware.name} states no power; "
                                 "set cost.gpu_power_W and cost.host_power_W (W)")])
    return gpu, host
