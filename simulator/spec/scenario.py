"""The scenario: what a user asks the simulator about, typed and frozen.

YAML is only how a scenario is stored. :func:`simulator.spec.load.load_scenario` reads
it, applies ``--set key.path=value`` overrides, resolves the model preset and the
hardware system, and returns a :class:`Scenario` or raises ``ScenarioError`` with one
line per problem (field, value, fix) — every problem, not just the first. This module
holds the sections (the model's and a long run's are in :mod:`simulator.spec.model_spec`
and :mod:`simulator.spec.job_spec`); the rules across them are
:mod:`simulator.spec.rules`.

Keys are the user-facing contract (README "Scenario reference"); unknown keys are
errors with the closest valid key suggested. Files are read through
:mod:`simulator.loading` (bounded, UTF-8, unique keys) and validated strictly: a
whole number must be written as one (``true``, ``"8"``, ``0x80`` and ``128.0`` are
refused for an integer), and every number has a finite, physical range. Every
value the schema accepts is simulated by the engine; nothing is silently treated as
something else.
"""

from __future__ import annotations

import itertools
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from simulator.errors import Problem, UserError
from simulator.schedules import registry
from simulator.schedules.registry import DEFAULT_SCHEDULE
from simulator.spec.base import MAX_SIZE, MAX_STAGES, Frozen, not_bool, printable, registered
from simulator.spec.job_spec import CheckpointSpec, CostSpec, ReliabilitySpec
from simulator.spec.model_spec import ModelSpec
from simulator.spec.stack import DEFAULT_STACK, StackSpec, load_stack
from simulator.spec.variability import VariabilitySpec
from simulator.system.collectives import registry as collective_registry
from simulator.system.hardware import HardwareProfile
from simulator.system.profiles import load_system
from simulator.system.units import Dtype

if TYPE_CHECKING:
    Schedule = str
    Algorithm = str
else:  # a name of the registry, read when a scenario is validated
    Schedule = registered(lambda: registry.SCHEDULES)
    Algorithm = registered(collective_registry.choosable)
Recompute = Literal["none", "selective", "full"]
Fidelity = Literal["folded", "full"]
Method = Literal["engine", "analytic"]


class ClusterSpec(Frozen):
    """How many nodes of which system; optional overrides of the system's numbers."""

    system: str  # preset name (`clustersim presets`) or path to a hardware-profile YAML
    nodes: int = Field(gt=0, le=MAX_SIZE)
    gpus_per_node: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    # per GPU, per direction
    intra_node_bandwidth_GBps: float | None = Field(default=None, ge=1e-3, le=1e12)
    # per GPU (its NIC)
    inter_node_bandwidth_GBps: float | None = Field(default=None, ge=1e-3, le=1e12)
    # α of both link classes
    link_latency_us: float | None = Field(default=None, ge=0, le=1e7)
    # fat-tree taper, 1 = non-blocking
    oversubscription: float | None = Field(default=None, ge=1, le=1e4)

    @model_validator(mode="before")
    @classmethod
    def _resolve_system(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("system"), str):
            return data
        try:
            hw = load_system(data["system"])
        except UserError:
            return data  # _check_system reports it against cluster.system
        if data.get("gpus_per_node") is None:  # absent or null: the system's
            return {**data, "gpus_per_node": hw.gpus_per_node}
        return data

    @field_validator("system")
    @classmethod
    def _check_system(cls, name: str) -> str:
        try:
            load_system(name)
        except UserError as exc:
            first = exc.problems[0]
            raise ValueError(first.fix if isinstance(first, Problem) else first) from None
        return name

    @property
    def gpus(self) -> int:
        assert self.gpus_per_node is not None
        return self.nodes * self.gpus_per_node


class OverlapSpec(Frozen):
    """Which communication runs on its own stream, overlapping compute."""

    dp: bool = True  # DP gradient buckets reduce while backward continues
    pp: bool = True  # pipeline send/recv on a separate stream
    zero3_prefetch: bool = True  # ZeRO-3 all-gathers the next unit ahead of use


class ParallelSpec(Frozen):
    """Degrees as Megatron-LM defines them (``parallel_state.initialize_model_parallel``):
    tp · cp · pp · dp ranks in all; the experts of a MoE layer are split over ``ep``
    ranks (each holding experts / ep of them, each expert's matrices split over
    ``expert_tp``), carved out of the tp · cp · dp ranks of a pipeline stage, so the
    expert layers see expert_tp · ep · edp = tp · cp · dp with edp the expert
    data-parallel degree."""

    tp: int = Field(default=1, gt=0, le=MAX_SIZE)
    pp: int = Field(default=1, gt=0, le=MAX_SIZE)
    dp: int = Field(default=1, gt=0, le=MAX_SIZE)
    cp: int = Field(default=1, gt=0, le=MAX_SIZE)  # context parallel: the sequence split
    # how CP ranks exchange keys and values (Megatron-LM's --cp-comm-type): p2p, ring
    # attention overlapped with the attention compute; allgather, before it (Llama 3)
    cp_comm_type: Literal["p2p", "allgather"] = "p2p"
    ep: int = Field(default=1, gt=0, le=MAX_SIZE)  # expert parallel: the experts split
    expert_tp: int | None = Field(default=None, gt=0, le=MAX_SIZE)  # default tp
    schedule: Schedule = DEFAULT_SCHEDULE
    # chunks per pipeline rank (interleaved)
    virtual_stages: int = Field(default=1, gt=0, le=MAX_SIZE)
    # layers of each stage (pp entries; pp · virtual_stages, in virtual-stage order, when
    # interleaved), summing to model.layers; default an even split (simulator/spec/placement.py)
    layers_per_stage: tuple[Annotated[int, Field(ge=0, le=MAX_SIZE)], ...] | None = Field(
        default=None, max_length=MAX_STAGES)
    # 0 DDP, 1 optimizer, 2 +gradients, 3 +parameters (FSDP)
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(not_bool)] = 0
    zero_offload: bool = False  # optimizer states and step on the host (ZeRO-Offload)
    fsdp_prefetch: int = Field(default=1, ge=0, le=1000)  # ZeRO-3 units gathered ahead
    reshard_after_forward: bool = True  # ZeRO-3 frees gathered params after forward
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    # DDP gradient bucket size, 1e6 bytes
    dp_bucket_MB: float = Field(default=25.0, ge=0.01, le=1e6)
    overlap: OverlapSpec = OverlapSpec()

    @field_validator("layers_per_stage", mode="before")
    @classmethod
    def _counts(cls, value: Any) -> Any:
        """YAML gives a list; strict validation wants the tuple the type names."""
        if isinstance(value, list):
            return tuple(value)
        return value

    @cached_property
    def layer_starts(self) -> tuple[int, ...]:
        """Running sums of ``layers_per_stage`` (first layer of each virtual stage, then
        the total); empty without it."""
        return tuple(itertools.accumulate(self.layers_per_stage or (), initial=0))

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def etp(self) -> int:
        """Expert tensor-parallel degree (Megatron's default: tp)."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: tp · cp · dp / (expert_tp · ep), when whole."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)


CompressionMethod = Literal["none", "powersgd", "onebit_adam", "bf16", "fp8"]


class GradientCompressionSpec(Frozen):
    """How data-parallel gradients are compressed
    (:mod:`simulator.strategies.compression.arithmetic`). A field
    left out takes the method's default; a field of another method is an error."""

    # none | powersgd (PyTorch's DDP hook) | onebit_adam (DeepSpeed's OnebitAdam) |
    # bf16 | fp8 (gradients reduced at 2 / 1 bytes per element on the wire)
    method: CompressionMethod = "none"
    # powersgd: matrix_approximation_rank r (default 4; PyTorch's default is 1)
    rank: int | None = Field(default=None, ge=1, le=65536)
    # powersgd: a matrix is compressed only if (n + m)·r · rate < n·m (PyTorch's default 2)
    min_compression_rate: float | None = Field(default=None, gt=0, le=1e6)
    # powersgd: start_powerSGD_iter, vanilla all-reduce before it (PyTorch's default 1000)
    start_step: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    # onebit_adam: uncompressed Adam warm-up steps before the variance freezes (DeepSpeed's
    # default 100000)
    freeze_step: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    # which step (0-based) the scenario describes; default: one after the warm-up (the
    # steady state). A step before start_step / freeze_step is simulated uncompressed.
    step: int | None = Field(default=None, ge=0, le=MAX_SIZE)


class TrainingSpec(Frozen):
    global_batch: int = Field(gt=0, le=MAX_SIZE)  # sequences per optimizer step (B)
    micro_batch: int = Field(default=1, gt=0, le=MAX_SIZE)  # sequences per micro-batch (b)
    dtype: Dtype = "bf16"  # training precision; optimizer is mixed-precision AdamW
    optimizer: Literal["adamw"] = "adamw"
    # data-parallel gradient compression (default none)
    gradient_compression: GradientCompressionSpec = GradientCompressionSpec()


class SimulationSpec(Frozen):
    method: Method = "engine"  # engine (discrete-event) or analytic (closed form)
    fidelity: Fidelity = "folded"  # folded: one rank per stage stands for its symmetric peers
    collective_algorithm: Algorithm = "auto"  # auto picks per collective like NCCL
    # seed of the random draws (failures in `clustersim train`); a step is deterministic
    seed: int = Field(default=0, ge=0, le=2**63 - 1)


class Scenario(Frozen):
    name: str = Field(min_length=1, max_length=200)
    description: str = Field(default="", max_length=10_000)
    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec
    simulation: SimulationSpec = SimulationSpec()
    reliability: ReliabilitySpec = ReliabilitySpec()  # failures (clustersim train)
    checkpoint: CheckpointSpec = CheckpointSpec()  # checkpoints (clustersim train)
    cost: CostSpec = CostSpec()  # energy and price (clustersim train)
    variability: VariabilitySpec = VariabilitySpec()  # stragglers, slow links, jitter
    # the training framework: a preset name or {preset: NAME, overrides} (simulator/spec/stack.py)
    stack: StackSpec = Field(default_factory=lambda: load_stack(DEFAULT_STACK))
    # a strategy outside ``parallel`` by name -> its own options (validated by the
    # strategy's options model: simulator/strategies/base.py)
    strategies: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=100)

    _name_printable = field_validator("name")(printable)

    @property
    def microbatches(self) -> int:
        """m: micro-batches per pipeline per step, B / (b · dp)."""
        return self.training.global_batch // (self.training.micro_batch * self.parallel.dp)

    @property
    def cp_keeps_gathered_kv(self) -> bool:
        """Whether context parallelism's all-gather variant keeps the gathered keys and
        values for the backward (``stack.cp_kv_backward: saved``), so that the backward
        does not all-gather them again."""
        return (self.parallel.cp > 1 and self.parallel.cp_comm_type == "allgather"
                and self.stack.cp_kv_backward == "saved")

    @cached_property
    def hardware(self) -> HardwareProfile:
        """The system profile with this scenario's cluster overrides applied."""
        return effective_hardware(self.cluster)

    @cached_property
    def stage_hardware(self) -> dict[int, HardwareProfile]:
        """Stages on another system (``variability.stage_systems``) -> its profile, with
        the cluster's GPUs per node (the cluster's link overrides are the base system's)."""
        out: dict[int, HardwareProfile] = {}
        for entry in self.variability.stage_systems:
            hw = load_system(entry.system).model_copy(
                update={"gpus_per_node": self.cluster.gpus_per_node})
            out.update(dict.fromkeys(entry.stages, hw))
        return out

    def hardware_of_stage(self, stage: int) -> HardwareProfile:
        return self.stage_hardware.get(stage) or self.hardware

    def to_dict(self) -> dict[str, Any]:
        """The scenario as its file would hold it (an empty ``strategies`` left out)."""
        out = self.model_dump(mode="json")
        if not out["strategies"]:
            del out["strategies"]
        return out


def effective_hardware(cluster: ClusterSpec) -> HardwareProfile:
    hw = load_system(cluster.system)
    intra, inter = hw.intra_node, hw.inter_node
    if cluster.intra_node_bandwidth_GBps is not None:
        intra = intra.model_copy(update={"bandwidth_GBps": cluster.intra_node_bandwidth_GBps})
    if cluster.inter_node_bandwidth_GBps is not None:
        inter = inter.model_copy(update={"bandwidth_GBps": cluster.inter_node_bandwidth_GBps})
    if cluster.link_latency_us is not None:
        intra = intra.model_copy(update={"latency_us": cluster.link_latency_us})
        inter = inter.model_copy(update={"latency_us": cluster.link_latency_us})
    if cluster.oversubscription is not None:
        inter = inter.model_copy(update={"oversubscription": cluster.oversubscription})
    return hw.model_copy(update={"gpus_per_node": cluster.gpus_per_node,
                                 "intra_node": intra, "inter_node": inter})


# ---------------------------------------------------------------- loading


