"""The scenario: what a user asks the simulator about, typed and frozen.

YAML is only how a scenario is stored. :func:`load_scenario` reads it, applies
``--set key.path=value`` overrides, resolves the model preset and the hardware
system, and returns a :class:`Scenario` or raises :class:`ScenarioError` with one
line per problem (field, value, fix) — every problem, not just the first.

Keys are the user-facing contract (README "Scenario reference"); unknown keys are
errors with the closest valid key suggested. Files are read through
:mod:`simulator.loading` (bounded, UTF-8, unique keys) and validated strictly: a
whole number must be written as one (``true``, ``"8"``, ``0x80`` and ``128.0`` are
refused for an integer), and every number has a finite, physical range. Every
value the schema accepts is simulated by the engine; nothing is silently treated as
something else.
"""

from __future__ import annotations

import difflib
import itertools
import math
import typing
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from simulator.errors import Problem, ScenarioError, UserError
from simulator.loading import MAX_DEPTH, PRESETS_DIR, parse_override, read_yaml
from simulator.schedules.schedule import SCHEDULES, requirements
from simulator.spec.placement import placement_problems
from simulator.spec.stack import DEFAULT_STACK, StackSpec, load_stack
from simulator.spec.variability import VariabilitySpec, variability_problems
from simulator.system.hardware import Dtype, HardwareProfile, load_system

MODELS_DIR = PRESETS_DIR / "models"
MAX_SIZE = 10**9  # a bound on every count and size: larger is a typo, not a model
MAX_STAGES = 100_000  # pp × virtual_stages: per-stage tables and closed forms loop over them

if TYPE_CHECKING:
    Schedule = str
else:  # the registry's names, as a Literal: the schema lists them, pydantic checks them
    Schedule = Literal[tuple(SCHEDULES)]
Recompute = Literal["none", "selective", "full"]
Fidelity = Literal["folded", "full"]
Method = Literal["engine", "analytic"]
Algorithm = Literal["auto", "ring", "tree", "hierarchical"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _not_bool(value: Any) -> Any:
    """Literal[0, 1, ...] would take ``true`` as 1: a boolean is not a number here."""
    if isinstance(value, bool):
        raise ValueError("must be a whole number, not true/false")
    return value


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("has control characters; use printable text")
    return text


class MLASpec(_Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through
    low-rank latents; each head's query/key is a no-position part plus a RoPE part."""

    q_lora_rank: int = Field(ge=0, le=MAX_SIZE)  # query latent; 0 = full-rank query projection
    kv_lora_rank: int = Field(gt=0, le=MAX_SIZE)  # the shared key/value latent
    qk_nope_head_dim: int = Field(gt=0, le=MAX_SIZE)  # per-head query/key width without RoPE
    qk_rope_head_dim: int = Field(gt=0, le=MAX_SIZE)  # RoPE width (the key part shared by heads)
    v_head_dim: int = Field(gt=0, le=MAX_SIZE)  # per-head value width

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class RouterSkewSpec(_Frozen):
    """Uneven expert loads (:mod:`simulator.strategies.expert_parallel`): each MoE layer's share of
    the routed tokens per expert is one draw from a symmetric Dirichlet distribution of
    ``concentration`` (small: a few experts take most tokens; large: near balanced),
    from a generator seeded with ``seed``. The most loaded expert-parallel rank sets the
    pace of the all-to-all and of the expert GEMMs."""

    distribution: Literal["dirichlet"] = "dirichlet"
    concentration: float = Field(default=1.0, ge=1e-3, le=1e6)  # Dirichlet alpha per expert
    seed: int = Field(default=0, ge=0, le=2**63 - 1)


class ModelSpec(_Frozen):
    """A decoder-only transformer. Defaults describe a GPT (Megatron) block.

    A mixture of experts replaces the MLP of its MoE layers by ``experts`` routed
    experts (``experts_per_token`` of them per token) plus ``shared_experts`` that
    every token passes through, each an MLP of width ``expert_ffn_hidden``. Layer i
    is a MoE layer when i >= first_dense_layers and (i - first_dense_layers) is a
    multiple of moe_layer_freq; the other layers keep the dense MLP of ffn_hidden.
    """

    preset: str | None = None  # the bundled preset these fields started from
    layers: int = Field(gt=0, le=MAX_SIZE)
    hidden: int = Field(gt=0, le=MAX_SIZE)  # h
    heads: int = Field(gt=0, le=MAX_SIZE)  # a, query heads
    kv_heads: int | None = Field(default=None, gt=0, le=MAX_SIZE)  # GQA when < heads; default heads
    ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_SIZE)  # default 4 × hidden
    vocab: int = Field(gt=0, le=MAX_SIZE)  # V
    seq_len: int = Field(gt=0, le=MAX_SIZE)  # s
    activation: Literal["gelu", "swiglu"] = "gelu"  # swiglu has three MLP matrices
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True  # linear layers carry biases (GPT) or not (LLaMA)
    tied_embeddings: bool = True  # output projection shares the input embedding
    position: Literal["learned", "rope"] = "learned"  # learned adds s × h parameters
    mla: MLASpec | None = None  # multi-head latent attention instead of (GQA) attention
    # mixture of experts; experts = 0 is a dense model
    experts: int = Field(default=0, ge=0, le=MAX_SIZE)  # routed experts per MoE layer
    experts_per_token: int = Field(default=1, gt=0, le=MAX_SIZE)  # top-k routing
    # width of one expert's MLP; default ffn_hidden
    expert_ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_SIZE)
    shared_experts: int = Field(default=0, ge=0, le=MAX_SIZE)  # experts every token uses
    first_dense_layers: int = Field(default=0, ge=0, le=MAX_SIZE)  # leading dense layers
    moe_layer_freq: int = Field(default=1, gt=0, le=MAX_SIZE)  # every k-th layer after them
    # None: dropless (every routed token is computed); c: each expert computes a fixed
    # buffer of c · k · tokens / experts, padded when short, tokens beyond it dropped
    capacity_factor: float | None = Field(default=None, ge=0.01, le=1e4)
    # softmax top-k (Mixtral) | sigmoid top-k with a per-expert bias (DeepSeek-V3)
    router: Literal["softmax", "sigmoid"] = "softmax"
    # None: every expert receives the same number of tokens
    router_skew: RouterSkewSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _resolve_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("preset") is not None:
            data = {**_preset_fields(data["preset"]), **data}
        if isinstance(data.get("heads"), int) and data.get("kv_heads") is None:
            data = {**data, "kv_heads": data["heads"]}
        if isinstance(data.get("hidden"), int) and data.get("ffn_hidden") is None:
            data = {**data, "ffn_hidden": 4 * data["hidden"]}
        if data.get("expert_ffn_hidden") is None and isinstance(data.get("ffn_hidden"), int):
            data = {**data, "expert_ffn_hidden": data["ffn_hidden"]}
        return data

    @property
    def kv(self) -> int:
        assert self.kv_heads is not None
        return self.kv_heads

    @property
    def ffn(self) -> int:
        assert self.ffn_hidden is not None
        return self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def expert_ffn(self) -> int:
        assert self.expert_ffn_hidden is not None
        return self.expert_ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has routed experts instead of the dense MLP."""
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers."""
        after = self.layers - self.first_dense_layers
        if not self.is_moe or after <= 0:
            return 0
        return -(-after // self.moe_layer_freq)


def _preset_fields(name: object) -> dict[str, Any]:
    if not isinstance(name, str) or not (MODELS_DIR / f"{name}.yaml").exists():
        near = difflib.get_close_matches(str(name), preset_model_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown model preset; {hint}bundled: {', '.join(preset_model_names())}")
    base = read_yaml(MODELS_DIR / f"{name}.yaml", "model.preset")
    assert isinstance(base, dict), f"preset {name} is not a mapping"
    return base


class ClusterSpec(_Frozen):
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
        return {"gpus_per_node": hw.gpus_per_node, **data}

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


class OverlapSpec(_Frozen):
    """Which communication runs on its own stream, overlapping compute."""

    dp: bool = True  # DP gradient buckets reduce while backward continues
    pp: bool = True  # pipeline send/recv on a separate stream
    zero3_prefetch: bool = True  # ZeRO-3 all-gathers the next unit ahead of use


class ParallelSpec(_Frozen):
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
    schedule: Schedule = "1f1b"
    # chunks per pipeline rank (interleaved)
    virtual_stages: int = Field(default=1, gt=0, le=MAX_SIZE)
    # layers of each stage (pp entries; pp · virtual_stages, in virtual-stage order, when
    # interleaved), summing to model.layers; default an even split (simulator/spec/placement.py)
    layers_per_stage: tuple[Annotated[int, Field(ge=0, le=MAX_SIZE)], ...] | None = Field(
        default=None, max_length=MAX_STAGES)
    # 0 DDP, 1 optimizer, 2 +gradients, 3 +parameters (FSDP)
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_bool)] = 0
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


class GradientCompressionSpec(_Frozen):
    """How data-parallel gradients are compressed (:mod:`simulator.strategies.compression`). A field
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


class TrainingSpec(_Frozen):
    global_batch: int = Field(gt=0, le=MAX_SIZE)  # sequences per optimizer step (B)
    micro_batch: int = Field(default=1, gt=0, le=MAX_SIZE)  # sequences per micro-batch (b)
    dtype: Dtype = "bf16"  # training precision; optimizer is mixed-precision AdamW
    optimizer: Literal["adamw"] = "adamw"
    # data-parallel gradient compression (default none)
    gradient_compression: GradientCompressionSpec = GradientCompressionSpec()


class SimulationSpec(_Frozen):
    method: Method = "engine"  # engine (discrete-event) or analytic (closed form)
    fidelity: Fidelity = "folded"  # folded: one rank per stage stands for its symmetric peers
    collective_algorithm: Algorithm = "auto"  # auto picks per collective like NCCL
    # seed of the random draws (failures in `clustersim train`); a step is deterministic
    seed: int = Field(default=0, ge=0, le=2**63 - 1)


class ReliabilitySpec(_Frozen):
    """Interruptions of a long run (``clustersim train``): hours between failures of
    one component, scaled by how many the cluster has (one interruption stops the
    whole synchronous job). A field left out takes the preset's rate."""

    # llama3: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 5 (466 interruptions
    # in 54 days on 16,384 H100); none: no interruptions unless a field below sets a rate
    preset: Literal["llama3", "none"] = "llama3"
    # hours between failures of one GPU (faulty GPU, HBM, SRAM, system processor, ...)
    gpu_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # hours between failures of one host (CPU, memory, SSD, power supply, maintenance, ...)
    host_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # hours between failures of one NIC
    nic_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # hours between failures of one NIC link's share of the fabric (cable, switch ports)
    switch_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # hours between software failures per host (bugs, dependencies, collective timeouts)
    software_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # hours between planned interruptions per host (upgrades): checkpoint, then restart
    planned_mtbf_h: float | None = Field(default=None, ge=1e-3, le=1e15)
    # seconds from an interruption to training again, before the reload: detection,
    # replacing the node, relaunching the job (an assumption: set your cluster's)
    restart_s: float = Field(default=600.0, ge=0, le=1e7)


class CheckpointSpec(_Frozen):
    """Checkpoints of a long run: where they go, how fast, and how often."""

    # seconds of training between checkpoints, or how to choose it: young (Young 1974),
    # daly (Daly 2006), auto (simulate a range of intervals, keep the best goodput)
    interval: Literal["auto", "young", "daly"] | float = "auto"
    # aggregate write bandwidth from the job to storage, 1e9 bytes/s (Llama 3 §3.3.1:
    # Tectonic sustains 2 TB/s for 16K GPUs; scale it to your cluster)
    storage_write_GBps: float = Field(default=2000.0, ge=1e-3, le=1e9)
    # aggregate read bandwidth for the reload after a restart; default the write bandwidth
    storage_read_GBps: float | None = Field(default=None, ge=1e-3, le=1e9)
    # false: training waits for the write to storage; true: it waits only for the copy to
    # host memory (over PCIe), the write proceeds in the background
    asynchronous: bool = False

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> Any:
        """One error line for the union (not one per member)."""
        if value in ("auto", "young", "daly"):
            return value
        if isinstance(value, bool) or not isinstance(value, float | int) \
                or not 1e-3 <= value <= 1e9:
            raise ValueError("must be auto, young, daly or seconds in [0.001, 1e9]")
        return float(value)


class CostSpec(_Frozen):
    """Energy and money of a long run."""

    # price of one GPU-hour in US dollars (an assumption: set your contract's price)
    usd_per_gpu_hour: float = Field(default=2.0, ge=0, le=1e6)
    # power usage effectiveness of the data centre: facility / IT energy (Google's
    # fleet reported a trailing-twelve-month PUE of 1.10 for 2023)
    pue: float = Field(default=1.1, ge=1, le=10)
    # board power of one GPU under load, W; default the system's `power.gpu_W`
    gpu_power_W: float | None = Field(default=None, ge=0, le=1e6)
    # power of one node without its GPUs (CPUs, memory, NICs, fans), W; default the
    # system's `power.host_W`
    host_power_W: float | None = Field(default=None, ge=0, le=1e7)


class Scenario(_Frozen):
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

    _name_printable = field_validator("name")(_printable)

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        problems = consistency_problems(self)
        if problems:
            # not a ValueError: pydantic must not wrap it; load_scenario passes it on
            raise ScenarioError(problems)
        return self

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
        return self.model_dump(mode="json")


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


def _divisor_list(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _divisors(n: int) -> str:
    divs = _divisor_list(n)
    return ", ".join(map(str, divs[:12])) + (", ..." if len(divs) > 12 else "")


def consistency_problems(s: Scenario) -> list[Problem]:
    """Rules across sections; each problem names the field, the value and the fix."""
    par, mdl, trn = s.parallel, s.model, s.training
    out: list[Problem] = []
    if s.stack.tp_overlap != "none" and par.tp > 1 and not par.sequence_parallel:
        out.append(Problem("stack.tp_overlap", s.stack.tp_overlap, "needs sequence "
                           "parallelism (Megatron-LM's arguments.py: TP communication "
                           "overlap only with --sequence-parallel); set "
                           "parallel.sequence_parallel: true or tp_overlap: none"))
    if s.cluster.gpus != par.world:
        out.append(Problem("parallel", f"tp({par.tp}) * cp({par.cp}) * pp({par.pp}) * "
                           f"dp({par.dp}) = {par.world}",
                           f"must equal cluster.nodes({s.cluster.nodes}) * gpus_per_node"
                           f"({s.cluster.gpus_per_node}) = {s.cluster.gpus}; change the degrees "
                           "or the cluster size"))
    if mdl.heads % par.tp:
        out.append(Problem("parallel.tp", par.tp, f"model.heads ({mdl.heads}) is not divisible by "
                           f"tp; use one of {_divisors(mdl.heads)}"))
    elif mdl.kv % par.tp and par.tp % mdl.kv:
        out.append(Problem("parallel.tp", par.tp, f"model.kv_heads ({mdl.kv}) and tp must divide "
                           "one another (KV heads are split or replicated across TP ranks)"))
    if mdl.kv > mdl.heads or mdl.heads % mdl.kv:
        out.append(Problem("model.kv_heads", mdl.kv, f"must divide model.heads ({mdl.heads}): "
                           "each KV head serves a whole group of query heads"))
    if mdl.hidden % mdl.heads and mdl.mla is None:
        out.append(Problem("model.hidden", mdl.hidden, f"not divisible by model.heads "
                           f"({mdl.heads}); head size must be whole"))
    out += placement_problems(mdl.layers, par)
    per_step = trn.micro_batch * par.dp
    if trn.global_batch % per_step:
        out.append(Problem("training.global_batch", trn.global_batch, f"not divisible by "
                           f"micro_batch({trn.micro_batch}) * dp({par.dp}) = {per_step}; use a "
                           f"multiple of {per_step}"))
    out += _schedule_problems(s, per_step)
    if par.sequence_parallel and mdl.seq_len % par.tp:
        out.append(Problem("parallel.sequence_parallel", True, f"model.seq_len ({mdl.seq_len}) "
                           f"is not divisible by tp({par.tp}); turn it off or change tp"))
    if par.zero_offload and par.zero == 0:
        out.append(Problem("parallel.zero_offload", True,
                           "ZeRO-Offload shards the optimizer; set zero: 1, 2 or 3"))
    from simulator.strategies.compression import compression_problems  # it reads Scenario fields

    return out + moe_problems(mdl) + expert_parallel_problems(s) + \
        context_parallel_problems(s) + compression_problems(s) + \
        variability_problems(s.variability, par.world, par.pp)


def moe_problems(mdl: ModelSpec) -> list[Problem]:
    """The mixture-of-experts and latent-attention fields of a model, among themselves."""
    out: list[Problem] = []
    if not mdl.is_moe:
        dense_defaults = {"experts_per_token": 1, "shared_experts": 0, "first_dense_layers": 0,
                          "moe_layer_freq": 1, "capacity_factor": None, "router_skew": None}
        for name, default in dense_defaults.items():
            if getattr(mdl, name) != default:
                out.append(Problem(f"model.{name}", getattr(mdl, name), "only for a mixture of "
                                   "experts (model.experts = 0); set model.experts or remove it"))
    else:
        if mdl.experts_per_token > mdl.experts:
            out.append(Problem("model.experts_per_token", mdl.experts_per_token,
                               f"more than model.experts ({mdl.experts}); use at most "
                               f"{mdl.experts}"))
        if mdl.first_dense_layers >= mdl.layers:
            out.append(Problem("model.first_dense_layers", mdl.first_dense_layers,
                               f"leaves no MoE layer among model.layers ({mdl.layers}); use "
                               f"fewer than {mdl.layers}"))
    if mdl.mla is not None and mdl.kv != mdl.heads:
        out.append(Problem("model.kv_heads", mdl.kv, f"latent attention (model.mla) gives every "
                           f"head its own key and value; set kv_heads = heads ({mdl.heads}) or "
                           "leave it out"))
    return out


def expert_parallel_problems(s: Scenario) -> list[Problem]:
    """Megatron-LM's rules (parallel_state.initialize_model_parallel, arguments.py): the
    expert layers use expert_tp · ep · edp = tp · cp · dp ranks per stage, and every
    expert-parallel rank holds the same number of experts."""
    par, mdl = s.parallel, s.model
    out: list[Problem] = []
    if par.ep > 1 and not mdl.is_moe:
        out.append(Problem("parallel.ep", par.ep, "the model has no routed experts "
                           "(model.experts = 0); set ep: 1 or use a mixture of experts"))
        return out
    if par.expert_tp is not None and not mdl.is_moe:
        out.append(Problem("parallel.expert_tp", par.expert_tp, "only for a mixture of experts "
                           "(model.experts = 0); remove it"))
        return out
    stage = par.tp * par.cp * par.dp
    if mdl.is_moe and mdl.experts % par.ep and not stage % (par.etp * par.ep):
        out.append(Problem("parallel.ep", par.ep, f"model.experts ({mdl.experts}) is not "
                           f"divisible by ep; use one of {_divisors(mdl.experts)}"))
    if stage % (par.etp * par.ep):  # its fix lists only degrees that divide the experts too
        fits = expert_parallel_degrees(mdl.experts, stage, par.etp)[:12]
        out.append(Problem("parallel.ep", par.ep, f"expert_tp({par.etp}) * ep({par.ep}) = "
                           f"{par.etp * par.ep} does not divide tp({par.tp}) * cp({par.cp}) * "
                           f"dp({par.dp}) = {stage}: expert-parallel ranks are carved out of a "
                           f"stage's tp * cp * dp ranks; use ep one of "
                           f"{', '.join(map(str, fits)) or 'none (change expert_tp)'}"))
    return out


def expert_parallel_degrees(experts: int, stage: int, etp: int) -> list[int]:
    """The ep degrees :func:`expert_parallel_problems` accepts for ``experts`` routed
    experts on a stage of ``stage`` = tp · cp · dp ranks with expert tensor parallelism
    ``etp``: divisors of the experts whose etp · ep divides the stage, ascending."""
    return [d for d in _divisor_list(experts) if stage % (etp * d) == 0]


def context_parallel_problems(s: Scenario) -> list[Problem]:
    """Megatron-LM splits the sequence into 2 · cp chunks (rank r takes chunks r and
    2cp − 1 − r, balancing causal attention), each divisible by tp with sequence
    parallelism."""
    par, mdl = s.parallel, s.model
    if par.cp == 1:
        return []
    out: list[Problem] = []
    if mdl.seq_len % (2 * par.cp):
        out.append(Problem("parallel.cp", par.cp, f"model.seq_len ({mdl.seq_len}) is not "
                           f"divisible by 2 * cp = {2 * par.cp} (two balanced chunks per rank); "
                           "change cp or seq_len"))
    elif par.sequence_parallel and (mdl.seq_len // par.cp) % par.tp:
        out.append(Problem("parallel.cp", par.cp, f"seq_len / cp = {mdl.seq_len // par.cp} is "
                           f"not divisible by tp({par.tp}) under sequence_parallel; change cp, "
                           "tp or seq_len"))
    return out


def not_yet_simulated(s: Scenario) -> list[Problem]:
    """What validates and has a memory model but no workload yet: context parallelism
    with experts or latent attention, latent attention in a dense model, the
    combinations of a mixture of experts that the expert pass
    (:mod:`simulator.strategies.expert`) does not build, and TP communication overlap with
    either of those."""
    par, mdl = s.parallel, s.model
    out = []
    if par.cp > 1 and (mdl.is_moe or mdl.mla is not None):
        out.append(Problem("parallel.cp", par.cp, "not yet simulated with a mixture of experts "
                           "or latent attention (the expert grid and the latent attention core "
                           "under CP are not modelled); use cp: 1"))
    if mdl.mla is not None and not mdl.is_moe:
        out.append(Problem("model.mla", "set", "not yet simulated: latent attention has "
                           "parameter, FLOP and memory arithmetic (clustersim memory), but run "
                           "needs its workload ops; use a model without mla"))
    if mdl.is_moe and par.tp > 1 and not par.sequence_parallel:
        out.append(Problem("parallel.sequence_parallel", False, "a mixture of experts with "
                           f"tp({par.tp}) > 1 needs sequence parallelism (Megatron-LM's "
                           "arguments.py requires it: each TP rank dispatches its sequence "
                           "shard); set sequence_parallel: true"))
    if s.stack.tp_overlap != "none" and par.tp > 1 and (mdl.is_moe or par.cp > 1):
        field, value = ("model.experts", mdl.experts) if mdl.is_moe else ("parallel.cp", par.cp)
        out.append(Problem(field, value, f"not yet simulated with stack.tp_overlap "
                           f"{s.stack.tp_overlap} (TP overlap is modelled for dense layers "
                           "without context parallelism); use tp_overlap: none"))
    if mdl.is_moe and (par.zero == 3 or par.zero_offload):
        field, value = ("parallel.zero", 3) if par.zero == 3 else ("parallel.zero_offload", True)
        out.append(Problem(field, value, "not yet simulated for a mixture of experts (expert "
                           "states shard over the expert data-parallel group); use zero 0, 1 "
                           "or 2 without offload"))
    return out


def _schedule_problems(s: Scenario, per_step: int) -> list[Problem]:
    """What the schedule's registry entry requires of pp, micro-batches and chunks."""
    par, trn = s.parallel, s.training
    m = trn.global_batch // per_step
    out = []
    for req in requirements(par.schedule, par.pp, m, par.virtual_stages):
        if req.field == "virtual_stages":
            out.append(Problem("parallel.virtual_stages", par.virtual_stages, req.text))
        elif not trn.global_batch % per_step:  # m is only meaningful when it is whole
            out.append(Problem("training.global_batch", trn.global_batch,
                               f"{req.text}; use global_batch a multiple of "
                               f"{per_step * req.multiple}"))
    return out


def scenario_warnings(s: Scenario) -> list[str]:
    """Legal but probably unintended choices."""
    out = []
    gpn = s.cluster.gpus_per_node or 1
    if s.parallel.tp > gpn:
        out.append(f"warning: parallel.tp = {s.parallel.tp} is larger than a node "
                   f"({gpn} GPUs): TP collectives cross the inter-node fabric")
    m = s.microbatches
    if s.parallel.pp > 1 and s.parallel.schedule in ("gpipe", "1f1b") and m < 4 * s.parallel.pp:
        bubble = (s.parallel.pp - 1) / (m + s.parallel.pp - 1)
        out.append(f"warning: m = {m} micro-batches for pp = {s.parallel.pp}: the bubble is "
                   f"{bubble:.0%} of the step (m >= {4 * s.parallel.pp} keeps it under ~20%)")
    from simulator.strategies.compression import compression_warnings

    return out + compression_warnings(s)


def preset_model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_preset_model(name: str) -> ModelSpec:
    return ModelSpec.model_validate({"preset": name})


# ---------------------------------------------------------------- loading


def apply_overrides(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings (value parsed as YAML) to a nested dict copy."""
    out: dict[str, Any] = _deep_copy(data)
    problems: list[Problem] = []
    for text in assignments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            problems.append(Problem("--set", text, "expected key.path=value, e.g. parallel.tp=4"))
            continue
        parts = key.strip().split(".")
        if len(parts) > MAX_DEPTH or not all(parts):
            problems.append(Problem("--set", text[:80], f"the key needs 1 to {MAX_DEPTH} "
                                    "non-empty dotted parts, e.g. parallel.tp=4"))
            continue
        value = parse_override(raw, f"--set {key.strip()}")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ScenarioError(problems)
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read, override, resolve and validate a scenario file."""
    path = Path(path)
    data = read_yaml(path, "scenario")
    if not isinstance(data, dict):
        raise ScenarioError([Problem("scenario", str(path), "the file must be a YAML mapping "
                                     "with keys name, model, cluster, parallel, training")])
    data = apply_overrides(data, overrides or [])
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("system"), str):
        system = cluster["system"]
        candidate = (path.parent / system)
        if system.endswith((".yaml", ".yml")) and not Path(system).is_absolute() \
                and candidate.exists():
            cluster["system"] = str(candidate.resolve())
    return scenario_from_dict(data)


def scenario_from_dict(data: Any) -> Scenario:
    """Validate a mapping into a Scenario, or raise ScenarioError listing every problem."""
    if not isinstance(data, dict):
        raise ScenarioError([Problem("scenario", type(data).__name__, "must be a mapping")])
    try:
        return Scenario.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ScenarioError([_problem(err, data) for err in exc.errors()]) from None


_WHOLE = "must be a whole number written in decimal, e.g. 128 (not true, \"8\", 0x80, 1_28, 128.0)"
_FIXES = {
    "missing": "required; add it",
    "int_type": _WHOLE,
    "int_parsing": _WHOLE,
    "int_from_float": _WHOLE,
    "float_type": "must be a number, e.g. 25 or 2.5e+1 (not true or a quoted string)",
    "float_parsing": "must be a number, e.g. 25 or 2.5e+1",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be text; quote it if it looks like a number, date or true/false",
    "dict_type": "must be a mapping of keys",
    "model_type": "must be a mapping of keys",
    "model_attributes_type": "must be a mapping of keys",
    "tuple_type": "must be a list, e.g. [7, 8, 8, 7]",
    "too_long": f"has too many entries: at most {MAX_STAGES:,}, one per pipeline stage",
}


def _problem(err: Any, data: dict[str, Any]) -> Problem:
    loc = [str(x) for x in err["loc"]]
    field = ".".join(loc) or "scenario"
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return Problem(field, value, _unknown_key_fix(loc))
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than_equal": "<=",
              "less_than": "<"}[kind]
        bound = next(iter(err.get("ctx", {}).values()), "")
        return Problem(field, value, f"must be {op} {bound}")
    if kind in ("literal_error", "enum"):
        return Problem(field, value, f"must be one of {err['ctx']['expected']}")
    if kind == "value_error":
        msg = str(err["msg"]).removeprefix("Value error, ")
        return Problem(field, value, msg)
    return Problem(field, value, _FIXES.get(kind, str(err["msg"])))


def _section_fields(loc: list[str]) -> list[str]:
    model: type[BaseModel] = Scenario
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        # an optional section (``mla: MLASpec | None``) names its model among the args
        ann = next((a for a in (ann, *typing.get_args(ann))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if ann is None:
            return []
        model = ann
    return list(model.model_fields)


def _unknown_key_fix(loc: list[str]) -> str:
    valid = _section_fields(loc)
    near = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"
