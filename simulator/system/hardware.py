"""Hardware profiles: what a GPU, a node and the fabric can do, as data.

A profile is the cost model's only source of numbers. Bundled presets
(``simulator/presets/systems/*.yaml``) come from datasheets and published
microbenchmarks, each number with its source in a comment; a calibrated profile
(``clustersim calibrate``) has the same schema and records its provenance; a scenario
names either in ``cluster.system`` (a preset's name or a path).

Achievable efficiency is data too: a piecewise-linear curve over log10(problem size)
(GEMM FLOPs, bytes moved), clamped at both ends, per cost class where
``gpu.class_efficiency`` has one (:meth:`GPUSpec.efficiency`), with a GEMM's tile and wave
quantisation where ``gpu.gemm_tiles`` lists its library's tiles
(:mod:`simulator.system.gemm_shape`). Link classes carry per-GPU bandwidth per direction,
a per-step latency α and the fraction of line rate collectives achieve (nccl-tests
busbw); ``intra_node`` joins one NVLink domain's GPUs (a node, or ``nvlink_domain_gpus``).
The optional terms (``interference``, the sync costs, the rank spread, ``uncertainty``,
which ``clustersim run --uncertainty`` propagates) are absent in a profile that has not
measured them: no slowdown, no sync cost, no spread.

A profile file is read strictly (:func:`load_system`): every field stated (a
profile without calibrated collectives says ``collectives: {}``, and calibrated
collectives need the provenance ``calibrate`` writes after them, so a file cut
short on a line boundary is refused, not silently completed with defaults), no
boolean or string where a number belongs, and every number finite and within a
physical range (:data:`RATE`, :data:`TIME_US`, ...): a rate of 0, 1e-300 or 1e300
would give infinite or zero times downstream and non-finite results.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from simulator.errors import Problem, UserError
from simulator.system.attention_kernels import AttentionCall, AttentionKernel, selected_kernel
from simulator.system.curves import (
    BurstCurve,
    EfficiencyCurve,
    HostLine,
    SpreadCurve,
    SyncCurve,
    known_keys,
)
from simulator.system.gemm_shape import GemmCall, Tiles, shape_factor
from simulator.system.link_specs import (
    AlphaBeta,
    HostSpec,
    InterNodeSpec,
    IntraNodeSpec,
    LinkSpec,
    PowerSpec,
)
from simulator.system.runtime_memory import NO_RUNTIME, RuntimeMemory
from simulator.system.units import (
    COST_CLASSES,
    LINK_NAMES,
    RATE,
    TIME_US,
    UNCERTAINTY_TERMS,
    CollectiveName,
    CostClass,
    FP8Recipe,
    Frozen,
    FuncolKind,
    FusedAttention,
    Interference,
    LinkClass,
    LinkName,
    PeakDtype,
    Rate,
    RelativeStd,
)


class GPUSpec(Frozen):
    name: str
    peak_tflops: dict[PeakDtype, Rate] = Field(min_length=1)  # dense peak per dtype, TFLOP/s
    # the FP8 recipes this GPU's tensor cores run (``stack.fp8``): delayed, current and
    # blockwise need an fp8 peak (Hopper and later); mxfp8 needs Blackwell's block-scaled
    # MMA. Absent: none, and a stack with fp8 is refused on this system
    fp8_recipes: tuple[FP8Recipe, ...] = ()
    # achieved / fp8 peak vs FLOPs of one FP8 GEMM (torch._scaled_mm); absent: the GEMM
    # classes' curves (the bf16 shape, an assumption until calibration measures it)
    fp8_gemm_efficiency: EfficiencyCurve | None = None
    memory_GB: float = Field(ge=1e-3, le=1e7)  # HBM capacity, 1e9 bytes
    hbm_bandwidth_GBps: float = RATE  # HBM bandwidth, 1e9 bytes/s
    gemm_efficiency: EfficiencyCurve  # achieved/peak vs FLOPs of one GEMM
    attention_efficiency: EfficiencyCurve  # achieved/peak vs FLOPs of one attention call
    memory_efficiency: EfficiencyCurve  # achieved/peak HBM bandwidth vs bytes moved
    kernel_overhead_us: float = Field(default=0.0, ge=0, le=1e7)  # fixed cost per kernel
    # communication runs beside compute: true on GPUs (NCCL on its own stream), false for
    # a CPU process whose one core also does gloo's copies and reductions
    comm_overlaps_compute: bool = True
    # a CPU "device": the thread that runs the kernels also runs the framework around them
    # (Python, dispatcher, autograd), so the host cost adds to each op instead of hiding
    # behind it, at this measured cost per kernel (calibration/measured/host_cost.py)
    # in place of the stack's GPU-host figure
    host_serial: bool = False
    host_overhead_us: float | None = Field(default=None, ge=0, le=1e5)
    # the host time DTensor adds to each op on DTensor operands (calibration/measured/
    # host_cost.py: the measured GPT under TP on a one-rank mesh against plain)
    dtensor_overhead_us: float | None = Field(default=None, ge=0, le=1e6)
    # the optimizer step's host cost per kernel, measured apart (its for-loop elementwise
    # kernels run without autograd around them: host_cost.py times the step at two
    # micro-batch counts); absent: host_overhead_us
    host_optimizer_us: float | None = Field(default=None, ge=0, le=1e5)
    # DTensor's host time for a GEMM on DTensor operands (sharding propagation of a
    # matmul and the views and transposes around it), measured apart from its other ops
    # (dtensor_overhead_us, the optimizer's included); absent: dtensor_overhead_us
    dtensor_gemm_us: float | None = Field(default=None, ge=0, le=1e6)
    # host time torch.distributed.pipelining spends per F or B action beyond the kernels
    # and sends (calibration/measured/pipeline_cost.py; absent: none), charged under a
    # stack with pipeline_runtime torch
    pipeline_action_us: float | None = Field(default=None, ge=0, le=1e6)
    # host time a functional collective (what DTensor's redistributions issue) takes beyond
    # a plain c10d one (calibration/measured/host_cost.py; absent: none), charged before
    # each TP collective of a dtensor stack
    funcol_overhead_us: float | None = Field(default=None, ge=0, le=1e6)
    # a curve per cost class; a class without one uses the generic curve of its kind
    class_efficiency: dict[CostClass, EfficiencyCurve] = Field(default_factory=dict)
    # fused attention kernels on their own curves over sequence length and head dimension
    # (simulator/system/attention_kernels.py), by the stack's attention; a kernel without
    # one, or a profile whose calibration measured attention_fwd / attention_bwd, uses those
    attention_kernels: dict[FusedAttention, AttentionKernel] = Field(default_factory=dict)
    # CUDA compute capability (NVIDIA's CUDA GPUs table: A100 8.0, H100/H200/H800 9.0),
    # which selects the kernel of a stack whose framework picks by architecture
    # (attention_kernels.selected_kernel); absent: pre-Hopper
    compute_capability: str | None = Field(default=None, pattern=r"^[1-9][0-9]?\.[0-9]$")
    # streaming multiprocessors (the GPU's architecture whitepaper: A100 108, H100/H800/
    # H200 SXM 132, B200 148): a communication kernel that holds some for its whole run
    # (DeepEP's, ``Plan.sms``) leaves the compute beside it the rest (absent: not priced)
    sms: int | None = Field(default=None, gt=0, le=100_000)
    # the CTA output tiles (Tm, Tn) the GEMM library runs large 16-bit GEMMs on, the best
    # quantising of them taken per shape: a GEMM's efficiency is the FLOPs curve times its
    # tile and wave quantisation (simulator/system/gemm_shape.py; needs ``sms``); absent:
    # by FLOPs alone
    gemm_tiles: Tiles = Field(default=(), max_length=16)
    # what a GEMM keeps of its curve by its reduction depth k, interpolated in log10(k) and
    # flat beyond the points (the per-tile costs a short k-loop does not amortise, measured:
    # docs/model.md "Reduction depth"; applied in gemm_shape_factor); absent: 1 at every depth
    gemm_depth: EfficiencyCurve | None = None
    # compute slowdown while a collective on that link class overlaps it (absent = 1)
    interference: dict[LinkName, Interference] = Field(default_factory=dict)
    # what a collective that follows compute costs beyond its back-to-back α-β time, once
    # per collective, per link class, µs: the communication threads wake and the ranks
    # arrive skewed (calibration/microbench/collective_sync.py; absent = 0)
    collective_sync_us: dict[LinkName, Annotated[float, TIME_US]] = Field(default_factory=dict)
    # the same by the collective's bytes, where the profile measured several sizes (the
    # cost grows with the message: 0.5-0.8 ms at 4 KiB, 0.9-1.4 ms at 1 MiB on this
    # project's VM); charged in place of collective_sync_us where present
    collective_sync_curve: dict[LinkName, SyncCurve] = Field(default_factory=dict)
    # what the same collective costs on top after a longer compute burst, by the burst
    # (the rank's compute since its previous collective): on this project's VM the cost
    # after 16 ms of compute is 1-2 ms above the cost after 1 ms, after a sleep of the
    # same length it is not (calibration/microbench/collective_sync.py; absent: none)
    collective_sync_burst: dict[LinkName, BurstCurve] = Field(default_factory=dict)
    # the same for a point-to-point send after compute, once per send, per link class, µs:
    # the receiver's blocking wait and the sender's threads waking
    # (calibration/microbench/send_sync.py; absent = 0)
    send_sync_us: dict[LinkName, Annotated[float, TIME_US]] = Field(default_factory=dict)
    # the issuing thread's time a DTensor redistribution (a functional collective) takes
    # beyond a plain c10d collective of the same kind and bytes, by kind, a line in the
    # bytes (calibration/microbench/funcol_host.py), charged before each TP collective
    # of a dtensor stack in place of funcol_sync_us and funcol_overhead_us
    funcol_host: dict[FuncolKind, HostLine] = Field(default_factory=dict)
    # profiles calibrated before funcol_host (2026-12-05): one figure per link class for
    # every kind, a DTensor all-reduce minus a plain one after a compute burst, its
    # ranks' skew included (absent: the one-rank funcol_overhead_us); no longer measured
    funcol_sync_us: dict[LinkName, Annotated[float, TIME_US]] = Field(default_factory=dict)
    # the relative spread c of a rank's compute time on the same work: every
    # synchronisation of an n-rank step waits for the slowest, so compute costs
    # 1 + c · e_n times its time (calibration/microbench/rank_spread.py; absent = 0)
    rank_spread: float = Field(default=0.0, ge=0, le=1)
    # the same measured over a GPU population, the slowest of n's excess by n (heavier
    # tailed than a normal); where present it replaces c · e_n (costs.CostModel)
    rank_excess: SpreadCurve | None = None
    # memory beside the tensors: context, workspaces, NCCL channels (RuntimeMemory);
    # absent: a CUDA GPU's defaults, none on a CPU device (runtime_memory)
    runtime: RuntimeMemory | None = None

    @field_validator("class_efficiency", mode="before")
    @classmethod
    def _cost_classes(cls, data: Any) -> Any:
        return known_keys(data, COST_CLASSES, "cost class")

    @field_validator("fp8_recipes", mode="before")
    @classmethod
    def _recipes(cls, data: Any) -> Any:
        return tuple(data) if isinstance(data, list) else data  # YAML lists; strict tuples

    @model_validator(mode="after")
    def _tiles_need_sms(self) -> GPUSpec:
        if self.gemm_tiles and self.sms is None:
            raise ValueError("gemm_tiles needs sms (the waves are counted on the SMs): "
                             "state gpu.sms or drop gemm_tiles")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without tiles (a depth curve, a population's spread) the field is left out, as a
        profile file leaves it out: a run's echo of the hardware (and its hash) reads as
        before the field."""
        out: dict[str, Any] = handler(self)
        if not self.gemm_tiles:
            out.pop("gemm_tiles", None)
        for name in ("gemm_depth", "rank_excess"):
            if getattr(self, name) is None:
                out.pop(name, None)
        return out

    @field_validator("attention_kernels", mode="before")
    @classmethod
    def _attention_kernels(cls, data: Any) -> Any:
        return known_keys(data, get_args(FusedAttention), "attention kernel")

    @field_validator("funcol_host", mode="before")
    @classmethod
    def _funcol_kinds(cls, data: Any) -> Any:
        return known_keys(data, get_args(FuncolKind), "functional collective")

    @field_validator("interference", "collective_sync_us", "collective_sync_curve",
                     "collective_sync_burst", "send_sync_us", "funcol_sync_us",
                     mode="before")
    @classmethod
    def _link_names(cls, data: Any) -> Any:
        return known_keys(data, LINK_NAMES, "link class")

    def efficiency(self, cost_class: str, size: float, call: AttentionCall | None = None,
                   precision: str = "", gemm: GemmCall | None = None) -> float:
        """Achieved / peak of one kernel of ``cost_class`` and ``size`` (FLOPs for GEMM
        and attention, bytes moved otherwise): the class's own curve when the profile
        has one (calibration measured it), else for a fused attention ``call`` its
        kernel's curves at the call's sequence length and head dimension where the
        profile has them, else ``gemm_efficiency``, ``attention_efficiency`` or
        ``memory_efficiency`` by the class's kind. An FP8 GEMM (``precision`` fp8) is on
        ``fp8_gemm_efficiency`` where the profile has it, else on its class's curve. A GEMM
        whose shape ``gemm`` is known keeps :meth:`gemm_shape_factor` of that."""
        if cost_class not in COST_CLASSES:
            raise ValueError(f"unknown cost class {cost_class!r}; one of {COST_CLASSES}")
        if gemm is not None and cost_class.startswith("gemm_"):
            return self.efficiency(cost_class, size, call, precision) \
                * self.gemm_shape_factor(gemm)
        if precision == "fp8" and self.fp8_gemm_efficiency is not None:
            return self.fp8_gemm_efficiency(size)
        curve = self.class_efficiency.get(cost_class)  # type: ignore[call-overload]
        if curve is None and call is not None:
            kernel = self.attention_kernels.get(  # type: ignore[call-overload]
                selected_kernel(call.kernel, self.compute_capability))
            if kernel is not None:
                return kernel.efficiency("bwd" if cost_class == "attention_bwd" else "fwd",
                                         call.seq_len, call.head_dim)
        if curve is None:
            curve = (self.gemm_efficiency if cost_class.startswith("gemm_")
                     else self.attention_efficiency if cost_class.startswith("attention_")
                     else self.memory_efficiency)
        return curve(size)

    def gemm_shape_factor(self, gemm: GemmCall) -> float:
        """What a GEMM of shape ``gemm`` keeps of its FLOPs curve's efficiency: its tile
        and wave quantisation on ``gemm_tiles`` and ``sms``
        (:func:`simulator.system.gemm_shape.shape_factor`; 1 without tiles) times what its
        reduction depth keeps, ``gemm_depth`` at k (1 without the curve)."""
        depth = self.gemm_depth(gemm.k) if self.gemm_depth is not None and gemm.k > 0 else 1.0
        if not self.gemm_tiles or self.sms is None:
            return depth
        return shape_factor(gemm, self.gemm_tiles, self.sms) * depth

    def runtime_memory(self) -> RuntimeMemory:
        """``runtime`` where the profile states it; else nothing on a CPU device
        (``host_serial``: gloo, no CUDA context, cuBLAS or NCCL) and a CUDA GPU's
        defaults otherwise (a profile calibrated before the field)."""
        if self.runtime is not None:
            return self.runtime
        return NO_RUNTIME if self.host_serial else RuntimeMemory()

    def interference_factor(self, link_class: str) -> float:
        """How many times slower compute runs while a collective on ``link_class``
        overlaps it (1.0 when the profile does not say)."""
        return self.interference.get(link_class, 1.0)  # type: ignore[call-overload]

    def collective_sync_s(self, link_class: str, size: float | None = None) -> float:
        """Seconds a collective of ``size`` bytes over ``link_class`` that follows compute
        costs beyond its back-to-back time: the profile's curve at ``size`` where it has
        one, else its one figure (0 when the profile does not say)."""
        curve = self.collective_sync_curve.get(link_class)  # type: ignore[call-overload]
        if curve is not None and size is not None and size > 0:
            return float(curve(size)) * 1e-6
        return self.collective_sync_us.get(link_class, 0.0) * 1e-6  # type: ignore[call-overload]

    def collective_sync_burst_s(self, link_class: str, burst_s: float) -> float:
        """Seconds a collective over ``link_class`` costs beyond :meth:`collective_sync_s`
        after ``burst_s`` seconds of compute: the profile's burst curve there, its
        shortest burst's value after none (0 when the profile has no curve)."""
        curve = self.collective_sync_burst.get(link_class)  # type: ignore[call-overload]
        if curve is None:
            return 0.0
        return float(curve(max(burst_s, 0.0))) * 1e-6

    def send_sync_s(self, link_class: str) -> float:
        """Seconds a point-to-point send over ``link_class`` that follows compute costs
        beyond its back-to-back time (0 when the profile does not say)."""
        return self.send_sync_us.get(link_class, 0.0) * 1e-6  # type: ignore[call-overload]

    def peak_flops(self, dtype: PeakDtype) -> float:
        if dtype not in self.peak_tflops:
            raise UserError([Problem("training.dtype", dtype,
                                     f"GPU {self.name} has no peak for it; profile lists "
                                     f"{sorted(self.peak_tflops)}")])
        return self.peak_tflops[dtype] * 1e12


class HardwareProfile(Frozen):
    name: str
    description: str = ""
    gpu: GPUSpec
    gpus_per_node: int = Field(gt=0, le=10_000)
    # GPUs one NVLink domain joins, a whole number of nodes: a GB200 NVL72 rack's 72 GPUs
    # over 18 trays of 4 talk over NVLink Switch, not the network; absent: one node
    nvlink_domain_gpus: int | None = Field(default=None, gt=0, le=100_000)
    intra_node: IntraNodeSpec  # NVSwitch (or NVLink) port of one GPU, across its domain
    inter_node: InterNodeSpec  # one NIC per GPU (rail), through the fat-tree
    host: HostSpec
    power: PowerSpec | None = None  # absent in calibrated profiles (not measured)
    # calibrated per-collective costs by link class; when present they replace the
    # link-derived α/β for that collective (see costs.py)
    collectives: dict[CollectiveName, dict[LinkName, AlphaBeta]] = Field(default_factory=dict)
    provenance: dict[str, Any] = Field(default_factory=dict)
    # relative standard deviation of each fitted term (calibration's repeat spread)
    uncertainty: dict[str, RelativeStd] = Field(default_factory=dict)

    @field_validator("uncertainty", mode="before")
    @classmethod
    def _terms(cls, data: Any) -> Any:
        return known_keys(data, UNCERTAINTY_TERMS, "uncertainty term")

    @model_validator(mode="after")
    def _whole_nodes(self) -> HardwareProfile:
        domain = self.nvlink_domain_gpus
        if domain is not None and domain % self.gpus_per_node:
            raise ValueError(f"nvlink_domain_gpus ({domain}) must be a multiple of "
                             f"gpus_per_node ({self.gpus_per_node}): a domain holds whole nodes")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without a domain of its own the field is left out, as a profile file leaves
        it out: a run's echo of the hardware (and its hash) reads as before the field."""
        out: dict[str, Any] = handler(self)
        if self.nvlink_domain_gpus is None:
            out.pop("nvlink_domain_gpus", None)
        return out

    @property
    def domain_gpus(self) -> int:
        """GPUs of one NVLink domain: what the ``intra_node`` link class joins."""
        return self.nvlink_domain_gpus or self.gpus_per_node

    def link(self, name: LinkName) -> LinkSpec:
        return self.intra_node if name == "intra_node" else self.inter_node

    @property
    def link_classes(self) -> tuple[LinkClass, ...]:
        """The link classes of this fabric: the core only when it is oversubscribed."""
        core: tuple[LinkClass, ...] = ("core",) if self.inter_node.oversubscription > 1 else ()
        return ("intra_node", "inter_node", *core)

    def with_faster_link(self, link: LinkClass, factor: float) -> HardwareProfile:
        """This profile with one link class ``factor`` times faster, the others as they
        are: a transfer over it takes 1/``factor`` of the time (bandwidth × factor, α and
        the calibrated collectives' α / factor, their busbw × factor). The core's capacity
        is the NICs' sum / oversubscription, so a faster NIC raises the oversubscription
        by the same factor (the core stays as it was) and a faster core lowers it; at 1
        or below the core can no longer be the bottleneck and is not modelled."""
        if not factor > 0:
            raise ValueError(f"speed factor {factor} must be > 0")
        inter = self.inter_node
        if link == "core":
            over = inter.oversubscription / factor
            # model_copy skips validation: an oversubscription under 1 means a core
            # faster than all NICs together, which the topology treats as non-blocking
            return self.model_copy(update={"inter_node": inter.model_copy(
                update={"oversubscription": over})})
        spec = self.link(link)
        faster = spec.model_copy(update={"bandwidth_GBps": spec.bandwidth_GBps * factor,
                                         "latency_us": spec.latency_us / factor})
        if link == "inter_node" and inter.oversubscription > 1:
            faster = faster.model_copy(update={"oversubscription": inter.oversubscription
                                               * factor})
        collectives = {op: {name: (ab.model_copy(update={"alpha_us": ab.alpha_us / factor,
                                                         "busbw_GBps": ab.busbw_GBps * factor})
                                   if name == link else ab) for name, ab in by_link.items()}
                       for op, by_link in self.collectives.items()}
        return self.model_copy(update={link: faster, "collectives": collectives})
