"""The scenario: what a user asks the simulator about, typed and frozen.

YAML is only how a scenario is stored. :func:`simulator.spec.load.load_scenario` reads
it, applies ``--set key.path=value`` overrides, resolves the model preset and the
hardware system, and returns a :class:`Scenario` or raises ``ScenarioError`` with one
line per problem (field, value, fix) — every problem, not just the first. This module
holds the sections (the model's and a long run's are in :mod:`simulator.spec.model_spec`
and :mod:`simulator.spec.job_spec`); the rules across them are
:mod:`simulator.spec.rules`.

Keys are the user-facing contract (docs/reference/scenario.md, written from this
schema; each field's docstring is its description there and in ``clustersim schema``);
unknown keys are errors with the closest valid key suggested. Files are read through
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

from simulator.schedules import registry
from simulator.schedules.registry import DEFAULT_SCHEDULE
from simulator.spec.base import MAX_SIZE, MAX_STAGES, Frozen, not_bool, printable, registered
from simulator.spec.cluster_spec import ClusterSpec, effective_hardware
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
Recompute = Literal["none", "selective", "full", "op"]
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                          "shared_experts"]
Fidelity = Literal["folded", "full"]
Method = Literal["engine", "analytic"]


class OverlapSpec(Frozen):
    """Which communication runs on its own stream, overlapping compute."""

    dp: bool = True
    """Data-parallel gradient buckets reduce on their own stream while the backward
    continues."""
    pp: bool = True
    """Pipeline sends and receives run on their own stream."""
    zero3_prefetch: bool = True
    """ZeRO-3 all-gathers the next unit ahead of its use."""

class ParallelSpec(Frozen):
    """Degrees as Megatron-LM defines them (``parallel_state.initialize_model_parallel``):
    tp · cp · pp · dp ranks in all; the experts of a MoE layer are split over ``ep``
    ranks (each holding experts / ep of them, each expert's matrices split over
    ``expert_tp``), carved out of the tp · cp · dp ranks of a pipeline stage, so the
    expert layers see expert_tp · ep · edp = tp · cp · dp with edp the expert
    data-parallel degree."""

    tp: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Tensor-parallel degree: each layer's matrices split over tp GPUs."""
    pp: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Pipeline-parallel degree: the layers split into pp stages."""
    dp: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Data-parallel degree: model replicas (sharded under ZeRO)."""
    cp: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Context-parallel degree: each sequence split over cp GPUs."""
    cp_comm_type: Literal["p2p", "allgather", "a2a", "a2a+p2p"] = "p2p"
    """How CP ranks exchange keys and values (Megatron-LM's ``--cp-comm-type``): p2p,
    ring attention overlapped with the attention compute; allgather, before it (Llama
    3); a2a, all-to-alls of Q, K, V and O (DeepSpeed-Ulysses); a2a+p2p, both (cp_a2a)."""
    cp_a2a: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """With cp_comm_type a2a+p2p, the all-to-all's degree: consecutive CP ranks in
    groups of cp_a2a, the ring over cp / cp_a2a of them (the first of Megatron-LM's
    ``--hierarchical-context-parallel-sizes``); must divide cp."""
    ep: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Expert-parallel degree: a MoE layer's experts split over ep GPUs, carved out of
    a stage's tp · cp · dp ranks."""
    expert_tp: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Tensor-parallel degree of the experts; default tp."""
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """How a MoE layer's tokens reach the experts and come back (Megatron-LM's
    ``--moe-token-dispatcher-type``, megatron/core/transformer/moe/token_dispatcher.py):
    ``alltoall`` (MoEAlltoAllTokenDispatcher), an all-to-all over the EP group and, with
    expert_tp > 1, an all-gather over the expert-TP group, each mirrored on the way back;
    ``allgather`` (MoEAllGatherTokenDispatcher), every token with its probabilities and
    routing map all-gathered over the expert-TP × EP group, the local experts' tokens
    picked out, a reduce-scatter back; ``flex`` (MoEFlexTokenDispatcher with
    ``--moe-flex-dispatcher-backend deepep``, or the older ``--moe-enable-deepep``),
    DeepEP's normal dispatch and combine kernels over the expert-TP × EP group, internode
    over RDMA to the same-index GPU of each target node, then NVLink within it, at the
    bandwidths DeepEP measured (:mod:`simulator.strategies.expert.deepep`). A per-run
    choice, like cp_comm_type, so it sits here rather than in the stack (which holds how a
    framework implements what it runs). Default alltoall (Megatron's own default is
    allgather; the importer sets it)."""
    moe_shared_expert_overlap: bool = False
    """The shared experts compute while the dispatch and combine exchanges are in flight
    (Megatron-LM's ``--moe-shared-expert-overlap``, megatron/core/transformer/moe/
    shared_experts.py: the first linear and activation beside the dispatch, the second
    linear beside the combine), the exchange on a stream of its own and the routed experts
    waiting for the dispatch; alltoall or flex only. No effect without shared experts."""
    schedule: Schedule = DEFAULT_SCHEDULE
    """Pipeline schedule (zbv: ZB-V, two chunks per rank in a V, set virtual_stages: 2;
    dualpipe: DeepSeek-V3's DualPipe, set virtual_stages: 2, even pp, even m >= 2 pp)."""
    virtual_stages: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Model chunks per pipeline rank (> 1 only with interleaved, any; or zbv and
    dualpipe, 2)."""
    layers_per_stage: tuple[Annotated[int, Field(ge=0, le=MAX_SIZE)], ...] | None = Field(
        default=None, max_length=MAX_STAGES)
    """Layers of each stage for an uneven split, e.g. [7, 8, 8, 7]: pp entries, or pp ·
    virtual_stages in virtual-stage order when interleaved (0 allowed; dualpipe: pp, each
    model stage held twice), summing to model.layers; default layers / pp each."""
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(not_bool)] = 0
    """ZeRO stage: 0 DDP, 1 shards optimizer states, 2 also gradients, 3 also
    parameters (FSDP)."""
    zero_offload: bool = False
    """Optimizer states and step on the host CPU (ZeRO-Offload)."""
    fsdp_prefetch: int = Field(default=1, ge=0, le=1000)
    """ZeRO-3 units gathered ahead of the one computing."""
    reshard_after_forward: bool = True
    """ZeRO-3 frees the gathered parameters after the forward (and gathers again for
    the backward)."""
    dp_shard: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    """Hybrid sharding (HSDP, FSDP's ``HYBRID_SHARD``, torchtitan's
    ``data_parallel_shard_degree``): ZeRO-3 shards over groups of dp_shard consecutive
    data-parallel ranks (with their cp peers) and replicates over the dp / dp_shard
    groups, all-reducing each reduced gradient shard across them; must divide dp, zero
    3 only. Default: dp, one shard group (full sharding)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (the attention core, or the modules of
    recompute_modules), full (each layer from its input) or op (torchtitan's per-op
    selective checkpointing: every second linear, and all but the linears, the
    attention core and the reduce-scatters re-run; dense standard-attention layers)."""
    recompute_modules: tuple[RecomputeModule, ...] | None = None
    """With recompute: selective, the modules recomputed, Megatron-Core's
    ``--recompute-modules``: core_attn (the attention core), layernorm (both norms'
    outputs), mlp (a dense layer's MLP), moe (a MoE layer's MoE block), shared_experts,
    moe_act (the routed experts' activation), mla_up_proj (latent attention's
    up-projections); default [core_attn]. A recomputed module issues again the
    collectives inside it (mlp its TP ones, moe also the dispatch and combine, core_attn
    the context-parallel exchange)."""
    recompute_num_layers: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    """With recompute: full, only the first N layers of each model chunk (each pipeline
    stage, each virtual stage when interleaved) are recomputed, the others not at all
    (Megatron-LM's ``--recompute-method block --recompute-num-layers N``); N at or above
    a chunk's layers recomputes all of them; default every layer."""
    recompute_every: int | None = Field(default=None, ge=1, le=MAX_SIZE)
    """With recompute: full, only every k-th layer of each pipeline rank (its k-th, 2k-th,
    ... counted over its chunks in order) is recomputed, the others not at all
    (torchtitan's ``activation_checkpoint.mode = "selective"`` with an integer
    ``selective_ac_option``); 1 is every layer; default every layer."""
    recompute_group: int | None = Field(default=None, ge=1, le=MAX_SIZE)
    """With recompute: full, each model chunk's layers in groups of N recomputed as one,
    keeping one input per group instead of one per layer (Megatron-LM's
    ``--recompute-method uniform --recompute-num-layers N``); default 1, every layer its
    own."""
    sequence_parallel: bool = False
    """Sequence parallelism (Megatron): norms and dropouts split over the TP ranks;
    all-gather and reduce-scatter instead of all-reduce."""
    dp_bucket_MB: float = Field(default=25.0, ge=0.01, le=1e6)
    """Data-parallel gradient bucket size, MB (1e6 bytes)."""
    overlap: OverlapSpec = OverlapSpec()
    """Which communication overlaps compute on its own stream."""
    fsdp: bool | None = Field(default=None, exclude=True)
    """Another name: fsdp: true is read as zero: 3 (FSDP's full sharding), with a
    warning; write zero: 3."""

    @model_validator(mode="before")
    @classmethod
    def _fsdp_means_zero3(cls, data: Any) -> Any:
        """``fsdp: true`` without a ``zero`` is ZeRO-3; a ``zero`` beside it is checked
        against it by :func:`simulator.spec.rules.consistency_problems`."""
        if isinstance(data, dict) and data.get("fsdp") is True and "zero" not in data:
            return {**data, "zero": 3}
        return data

    @field_validator("layers_per_stage", "recompute_modules", mode="before")
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
    def cp_a2a_degree(self) -> int:
        """CP ranks an all-to-all spans: cp (a2a), cp_a2a (a2a+p2p), else 1."""
        if self.cp == 1 or self.cp_comm_type == "a2a":
            return self.cp
        return (self.cp_a2a or 1) if self.cp_comm_type == "a2a+p2p" else 1

    @property
    def shard(self) -> int:
        """Ranks one ZeRO shard spans: dp_shard (default dp) times cp."""
        return (self.dp_shard or self.dp) * self.cp

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

    method: CompressionMethod = "none"
    """none, powersgd (PyTorch's DDP hook), onebit_adam (DeepSpeed's OnebitAdam), bf16
    or fp8 (gradients reduced at 2 / 1 bytes per element on the wire)."""
    rank: int | None = Field(default=None, ge=1, le=65536)
    """powersgd: matrix_approximation_rank r of P and Q; default 4 (PyTorch's is 1)."""
    min_compression_rate: float | None = Field(default=None, gt=0, le=1e6)
    """powersgd: an n × m matrix is compressed only if (n + m) · r · rate < n · m;
    default 2 (PyTorch's)."""
    start_step: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    """powersgd: start_powerSGD_iter, vanilla all-reduce before it; default 1000
    (PyTorch's)."""
    freeze_step: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    """onebit_adam: uncompressed Adam warm-up steps before the variance freezes;
    default 100000 (DeepSpeed's)."""
    step: int | None = Field(default=None, ge=0, le=MAX_SIZE)
    """The step (0-based) the scenario describes; default one after the warm-up (the
    steady state). A step before start_step / freeze_step is simulated uncompressed."""

class TrainingSpec(Frozen):
    """The batch, the precision and the optimizer of one training step."""

    global_batch: int = Field(gt=0, le=MAX_SIZE)
    """Sequences per optimizer step (B)."""
    micro_batch: int = Field(default=1, gt=0, le=MAX_SIZE)
    """Sequences per micro-batch (b)."""
    dtype: Dtype = "bf16"
    """Training precision; the optimizer is mixed-precision AdamW."""
    optimizer: Literal["adamw"] = "adamw"
    """The optimizer (AdamW)."""
    gradient_compression: GradientCompressionSpec = GradientCompressionSpec()
    """Data-parallel gradient compression; none by default."""

class SimulationSpec(Frozen):
    """How the step is simulated."""

    method: Method = "engine"
    """engine (discrete-event) or analytic (closed form, milliseconds)."""
    fidelity: Fidelity = "folded"
    """folded: one rank per stage stands for its symmetric peers; full: every rank (a TP
    group whose ranks provably run alike as one lock-step process, its spans copied to
    each member: the same figures as per rank)."""
    collective_algorithm: Algorithm = "auto"
    """auto: NCCL's choice of algorithm and protocol per collective; or one algorithm
    for every collective (the textbook α-β form)."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seed of the random draws (the failures of ``clustersim train``); a step is
    deterministic."""

class Scenario(Frozen):
    """A training-cluster scenario: a model, a cluster, a parallel layout, a batch."""

    name: str = Field(min_length=1, max_length=200)
    """The scenario's name (the default output directory is out/<name>)."""
    description: str = Field(default="", max_length=10_000)
    """Free text: what the scenario demonstrates and its sources."""
    model: ModelSpec
    """The transformer: a preset, fields, or a preset with overrides."""
    cluster: ClusterSpec
    """The machines: a system and how many nodes."""
    parallel: ParallelSpec = ParallelSpec()
    """The parallel layout: degrees, schedule, ZeRO, recomputation, overlap."""
    training: TrainingSpec
    """Batch, micro-batch, precision, gradient compression."""
    simulation: SimulationSpec = SimulationSpec()
    """Method, fidelity, collective algorithm, seed."""
    reliability: ReliabilitySpec = ReliabilitySpec()
    """Failures of a long run (``clustersim train`` only)."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Checkpoints of a long run (``clustersim train`` only)."""
    cost: CostSpec = CostSpec()
    """Energy and price of a long run (``clustersim train`` only)."""
    variability: VariabilitySpec = VariabilitySpec()
    """Stragglers, slow links and jitter."""
    stack: StackSpec = Field(default_factory=lambda: load_stack(DEFAULT_STACK))
    """The training framework: a stack preset name, or {preset: NAME, field: value,
    ...}; default megatron-core."""
    strategies: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=100)
    """Options of a strategy outside ``parallel``, by strategy name (validated by the
    strategy's own options model)."""

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


# ---------------------------------------------------------------- loading


