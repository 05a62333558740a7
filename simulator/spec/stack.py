"""The training software stack as data: what a framework actually runs.

The same model on the same GPUs runs different programs under Megatron-LM 2021,
Megatron Core with Transformer Engine, torchtitan, DeepSpeed or plain PyTorch: the
attention kernel (unfused baddbmm + softmax + dropout + bmm, or one FlashAttention
call), which elementwise ops are fused, the dtype gradients accumulate and reduce in,
how the optimizer launches its kernels, whether pipeline sends block, whether the
gradient reduction overlaps the backward, and what the host pays per kernel. A
:class:`StackSpec` says all of it; :mod:`simulator.model.transformer` derives the kernel-level op
inventory (compute and what is kept for backward) from model + stack, and
:mod:`simulator.model.memory` reads the same inventory, so compute and memory describe one
program.

Presets live in ``simulator/presets/stacks/*.yaml``, every value with its source (the
framework's file and flag, or its documentation) in a comment; none is fitted to
published end-to-end throughput. A scenario names one with ``stack: NAME`` or
``stack: {preset: NAME, <field>: <value>, ...}``; without a ``stack`` section it runs
:data:`DEFAULT_STACK`, and a mapping without a preset overrides that default.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from simulator.loading import PRESETS_DIR, read_yaml
from simulator.system.units import FP8Recipe, FusedAttention

if TYPE_CHECKING:
    from simulator.spec.scenario import OverlapSpec

STACKS_DIR = PRESETS_DIR / "stacks"
DEFAULT_STACK = "megatron-core"

#: unfused: baddbmm, scale + mask + softmax as separate kernels, dropout, bmm;
#: unfused_fused_softmax: the same with one fused scale-mask-softmax kernel (Megatron's
#: FusedScaleMaskSoftmax); flash2 / flash3 / cudnn / flash1 / flash_triton: one fused
#: kernel forward (and its backward), no s×s matrix in memory, masked blocks of a causal
#: mask skipped: FlashAttention-2, FlashAttention-3, cuDNN's fused attention,
#: FlashAttention (v1) or FlashAttention in Triton, each priced on its own curves where
#: the hardware profile has them (``gpu.attention_kernels``).
#: te: Transformer Engine's choice by architecture, cuDNN's from Hopper on, FlashAttention-2
#: before (simulator/system/attention_kernels.py ``selected_kernel``).
Attention = Literal["unfused", "unfused_fused_softmax", FusedAttention, "te"]
#: projections: QKV as one GEMM and SwiGLU's gate and up as one; bias_act: bias add and
#: GeLU (or SwiGLU's silu · up) in one kernel; bias_dropout_add: bias, dropout and
#: residual add in one kernel; rope: rotary embedding as one kernel; cross_entropy: the
#: loss as one fused kernel; bias_gemm: the bias added inside the GEMM (nn.Linear's
#: ``addmm``), so neither the activation nor the residual launches a bias kernel.
Fusion = Literal["projections", "bias_act", "bias_dropout_add", "rope", "cross_entropy",
                 "bias_gemm"]
GradDtype = Literal["fp32", "param"]
#: An AdamW moment's storage: the dtypes Megatron-LM's ``--exp-avg-dtype`` and
#: ``--exp-avg-sq-dtype`` take (megatron/training/arguments.py, choices fp32, fp16, bf16,
#: fp8), which Transformer Engine's FusedAdam stores (fp8 as one byte with a scale per tensor)
StateDtype = Literal["fp32", "bf16", "fp16", "fp8"]
#: Bytes of one element of each optimizer-state dtype
STATE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class StackSpec(BaseModel):
    """One training framework's choices (a preset, optionally overridden field by field)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False,
                              use_attribute_docstrings=True)

    preset: str | None = None
    """A bundled stack preset (``clustersim presets``) these fields start from; fields
    given beside it override the preset's."""
    name: str = Field(min_length=1, max_length=100)
    """The stack's name (a preset's own)."""
    description: str = Field(default="", max_length=2000)
    """Free text: the framework and version the preset describes."""
    attention: Attention
    """The attention kernel: unfused (baddbmm, softmax, dropout, bmm as separate
    kernels), unfused_fused_softmax (Megatron's fused scale-mask-softmax), flash2,
    flash3, cudnn, flash1 (FlashAttention v1) or flash_triton (FlashAttention in Triton,
    llm-foundry's attn_impl triton) (one fused kernel, no s×s matrix in memory), or te
    (Transformer Engine's choice by GPU architecture)."""
    attention_dropout: float = Field(ge=0, lt=1)
    """Dropout probability on the softmax output (unfused kernels)."""
    hidden_dropout: float = Field(ge=0, lt=1)
    """Dropout probability after the output projection, after the MLP and on the
    embeddings."""
    fusions: tuple[Fusion, ...] = ()
    """Fused kernels: projections (QKV as one GEMM, SwiGLU's gate and up as one),
    bias_act, bias_dropout_add, rope, cross_entropy, bias_gemm (the bias added inside
    the GEMM)."""
    main_grads: GradDtype
    """The dtype gradients accumulate in across micro-batches: fp32 (main grads) or
    param (the parameters' dtype)."""
    grad_reduce_dtype: GradDtype
    """The dtype of the data-parallel gradient reduction: fp32 or param."""
    grad_reduce: Literal["overlapped", "after_backward"]
    """The data-parallel reduction runs during the backward (overlapped) or after it."""
    optimizer: Literal["fused", "foreach", "per_tensor"]
    """How AdamW launches its kernels: one fused kernel, foreach (a few per group of
    tensors) or per tensor."""
    optimizer_loop: Literal["torch", "composer"] = "torch"
    """Whose op-by-op AdamW runs where ``optimizer`` is not fused (:func:`simulator.model.
    inventory.optimizer.unfused_bytes`): torch.optim.AdamW's, or Composer's DecoupledAdamW,
    which reads each step count back (``.item()``): the step's host and device time add."""
    train_metrics: int = Field(default=0, ge=0, le=16)
    """Cross-entropy metrics the trainer computes from each micro-batch's logits after its
    backward (Composer's ``_eval_train_metrics``: llm-foundry's LanguageCrossEntropy and
    LanguagePerplexity), forward only, in fp32 (autocast's cross_entropy), or in the
    logits' dtype under FP8 (Composer's amp_fp8 enters no torch.autocast):
    :func:`simulator.model.inventory.loss.metric_ops`."""
    grad_clip: bool = True
    """Global-norm gradient clipping before the step (reads and scales the gradients)."""
    pipeline_send: Literal["blocking", "async"]
    """Pipeline sends: compute waits for them (blocking) or not (async)."""
    pipeline_runtime: Literal["megatron", "deepspeed", "torch"] = "megatron"
    """The code that runs a pipeline stage's actions: Megatron's schedules, DeepSpeed's
    PipelineEngine, or torch.distributed.pipelining (whose per-action host time a
    profile may have measured, ``gpu.pipeline_action_us``)."""
    tp_overlap: Literal["none", "async", "bulk", "pipelined"] = "none"
    """TP collectives against the GEMMs next to them: none blocks the compute stream; async,
    Megatron's column-parallel backward; bulk and pipelined (SP) TE's userbuffers."""
    tp_overlap_runtime: Literal["userbuffers", "symmetric_memory"] = "userbuffers"
    """What runs them: TE's userbuffers (Megatron) or PyTorch's symmetric memory
    (torchtitan's async TP): simulator/strategies/tensor/overlap.py."""
    cuda_graphs: bool = False
    """Kernels replayed from a CUDA graph: no per-kernel host cost."""
    host_overhead_us: float = Field(ge=0, le=1e4)
    """Host time to issue one kernel in eager mode, µs."""
    nccl_version: str = Field(default="2.18", pattern=r"^\d+\.\d+(\.\d+)?$")
    """The NCCL version whose algorithms, protocols and tuning model pick what a
    collective runs under simulation.collective_algorithm: auto."""
    zero3_unit: Literal["layer", "module"] = "layer"
    """ZeRO-3 / FSDP collectives per layer: one for the whole layer (FSDP's unit, a transformer
    block), or one per linear module (DeepSpeed fetches each submodule's parameters;
    parameters under its persistence threshold, norms and biases, stay whole and are not
    gathered)"""
    hsdp_all_reduce: Literal["microbatch", "last"] = "microbatch"
    """Hybrid sharding's all-reduce of each reduced gradient shard across the replicas
    (``parallel.dp_shard``): after every micro-batch's reduce-scatter (FSDP's default),
    or only on the last micro-batch of a step, the earlier ones accumulating the reduced
    shard (FSDP2's ``set_requires_all_reduce(False)`` before them, as torchtitan's
    gradient accumulation calls it)."""
    fsdp_copies: bool = False
    """FSDP2's flat-buffer copies around each unit's collectives (torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py): the shard copied into the all-gather buffer
    (``all_gather_copy_in``; cast into a flat buffer first under a MixedPrecisionPolicy, a
    stack with fp32 main grads), the gathered buffer split into the parameters
    (``split_with_sizes_copy``), the gradients packed for the reduce-scatter (``chunk_cat``)
    and the reduced shard added to ``.grad`` on later micro-batches
    (:func:`simulator.model.inventory.sharding.fsdp_gather_ops`,
    :func:`~simulator.model.inventory.sharding.fsdp_reduce_ops`)"""
    norm_kernel: Literal["fused", "torch"] = "fused"
    """The normalisation kernels: torch (PyTorch's own ``layer_norm`` / ``rms_norm``,
    its backward's separate γ/β reduction included: what ``clustersim calibrate`` times as
    the ``norm`` class, priced on ``gpu.class_efficiency.norm`` where the profile has
    it) or fused (a framework's own: Transformer Engine's, apex's, a compiled one;
    priced as an elementwise kernel of its bytes, the γ/β sums as a reduction)."""
    flash_unpad: bool = False
    """flash-attn's kernels (flash1, flash2) called on packed tokens through its
    ``bert_padding`` helpers, as llm-foundry's ``flash_attn_fn`` calls them on every forward
    (a mask of ones when the batch has none): ``unpad_input`` on Q, K and V (each a mask
    sum, ``nonzero``, a max read back by ``.item()``, a cumsum and a ``torch.gather`` into a
    packed copy) and ``pad_input`` on the output (a zeroed buffer and an index put); their
    backward scatters each gradient into a zeroed buffer and gathers the output's. No
    effect on other kernels (llm-foundry's Triton path takes the padded tensors).
    (:func:`simulator.model.inventory.attention.unpad_ops`)"""
    qkv_grad_cat: bool = False
    """The fused QKV projection's output split into views the attention reads
    (``qkv.split``/``chunk``), whose gradients come back as three tensors that autograd's
    split backward concatenates into the projection's output gradient (one ``cat`` over
    T·(q + 2kv) elements: tools/autograd/derivatives.yaml split_with_sizes,
    ``split_with_sizes_backward``), as in llm-foundry's MPT (layers/attention.py
    ``GroupedQueryAttention.forward``;
    :func:`simulator.model.inventory.attention.qkv_split_ops`)"""
    fsdp_flat_param: bool = False
    """FSDP1's FlatParameter kernels around each unit's collectives (torch/distributed/fsdp/
    _runtime_utils.py, _flat_param.py): under mixed precision the fp32 shard cast to 16 bits
    before each all-gather (``_use_low_precision_shard``); the unit's gradients concatenated
    into the flat parameter's (autograd's split backward), cast to the reduce dtype, padded
    to the group and pre-divided before the reduce-scatter, post-divided, cast to the
    parameter dtype and added to the saved shard after it (``_post_backward_hook``,
    ``_reduce_grad``; :mod:`simulator.model.inventory.fsdp1`)"""
    ddp_copies: bool = False
    """torch DDP's Reducer with ``gradient_as_bucket_view=False`` (its default): each gradient is
    copied into its bucket, divided by the group size on the way (``at::mul_out``), and the
    reduced bucket copied back into the gradients after the backward (``copy_bucket_to_grad``;
    torch/csrc/distributed/c10d/reducer.cpp, ``mark_variable_ready_dense`` and
    ``finalize_bucket_dense``)"""
    ddp_first_bucket_MB: float = Field(default=0.0, ge=0, le=1e6)
    """torch DDP closes its first gradient bucket at this size (1e6 bytes), the others at
    ``parallel.dp_bucket_MB`` (torch/nn/parallel/distributed.py: first_bucket_bytes_cap =
    dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, and the Reducer's bucket rebuild after the first
    step keeps it); 0: every bucket ``dp_bucket_MB``"""
    moe_routing: Literal["fused", "eager"] = "fused"
    """how a mixture of experts routes its tokens into the experts' buffers and back: ``fused``,
    a permutation and an un-permutation kernel (Megatron-core's moe_utils.permute /
    unpermute); ``eager``, the capacity-buffer routing of plain PyTorch ops our measured MoE
    worker runs (calibration/measured/moe_worker.py, ``MoEMLP``: softmax, top-k, the one-hot
    slot count, masks, index and index_copy into the buffers, their transposed copies; the
    gate weighting, gather and sum after the combine), one kernel per op
    (:data:`simulator.model.inventory.experts.EAGER_ROUTING`)"""
    moe_experts: Literal["modules", "grouped"] = "modules"
    """how a MoE layer holds its routed experts' parameters: ``modules``, one MLP module per
    expert, so one tensor per projection per expert (Megatron-core's SequentialMLP and
    TEGroupedMLP, whose GroupedLinear keeps ``weight0`` … ``weight{n-1}``; DeepSpeed's
    ``Experts`` ModuleList; our measured MoE worker), or ``grouped``, one 3-D tensor per
    projection for all local experts (torchtitan's ``GroupedExperts``): what a per-tensor or
    foreach optimizer loops over"""
    cp_kv_backward: Literal["regather", "saved"] = "regather"
    """what the all-gather variant of context parallelism keeps for the backward: ``regather``,
    the rank's own key/value chunk, all-gathered again in backward (Transformer Engine's
    ``AttnFuncWithCPAndKVAllGather``: attention/dot_product_attention/context_parallel.py), or
    ``saved``, the gathered keys and values, so the backward has only the gradients'
    reduce-scatter (our measured CP worker's ``GatherKV``), at cp times the memory"""
    sp_input_backward: Literal["regather", "saved"] = "regather"
    """what the QKV and MLP-up projections keep of their input under sequence parallelism:
    ``regather``, the rank's shard, all-gathered again in backward (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``, TE's ``LayerNormLinear``), or
    ``saved``, the all-gathered tensor DTensor's matmul saves (torchtitan, PyTorch TP)"""
    dtensor: bool = False
    """TP and FSDP2 as DTensor (torch.distributed.tensor.parallel, fully_shard): every op on
    DTensors pays DTensor's dispatch and sharding propagation on the host (FSDP2's sharded
    parameters are DTensors: its optimizer step does; its forward and backward do not)"""
    autocast: bool = False
    """torch.autocast over fp32 parameters (PyTorch AMP): GEMMs and attention run in the training
    dtype on operands cast per call, norms, softmax and the loss in fp32
    (torch/csrc/autograd/autocast_mode.cpp's fp32 list), so the residual stream, its gradients
    and the parameters' gradients stay fp32 (:mod:`simulator.model.inventory`)"""
    master_weights: Literal["optimizer", "parameters"] = "optimizer"
    """where the fp32 master weights live under 16-bit training: in the optimizer's state beside
    16-bit parameters (the ZeRO paper's 2 + 2 + 12 bytes; Megatron's
    Float16OptimizerWithFloat16Params and distributed optimizer, DeepSpeed's bf16 optimizer),
    or in the ``parameters`` themselves, kept in fp32 and cast to 16 bits only for compute
    (PyTorch FSDP's mixed precision: FSDP1 frees its low-precision shard after each all-
    gather, torch/distributed/fsdp/_flat_param.py ``_free_low_precision_sharded_param``; FSDP2
    casts in the all-gather's copy-in): 4 + 4 + 8 bytes, and the optimizer step writes no
    16-bit copy"""
    loss: Literal["vocab_parallel", "torch", "flash"] = "vocab_parallel"
    """the cross-entropy's kernels without the ``cross_entropy`` fusion: Megatron's vocab-
    parallel form (max, subtract, exp, sum, log, gather in fp32: six kernels each way), or
    PyTorch's ``F.cross_entropy`` (``torch``: log_softmax and nll_loss,
    aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss``: two kernels forward, three
    backward); both keep an fp32 softmax for the backward. ``flash``: flash-attn's fused cross
    entropy (flash_attn/losses/cross_entropy.py, with or without the fusion): one kernel each
    way on the 16-bit logits, which it keeps with a per-row fp32 log-sum-exp, its backward
    writing a 16-bit gradient (``torch.empty_like(logits)``)"""

    exp_avg_dtype: StateDtype = "fp32"
    """The dtype AdamW's first moment (``exp_avg``) is stored in: fp32, or bf16, fp16 or fp8
    under Megatron-Core's precision-aware optimizer (``--use-precision-aware-optimizer
    --exp-avg-dtype``: Transformer Engine's FusedAdam keeps the state in that dtype and
    computes in fp32; megatron/core/optimizer/optimizer_config.py asserts fp32 without it)
    or torchtitan's ``optimizer.implementation = "fused_opt_states_bf16"`` (both moments
    bf16). DeepSeek-V3 keeps both moments in BF16 (arXiv:2412.19437, §3.3.3)."""
    exp_avg_sq_dtype: StateDtype = "fp32"
    """The dtype AdamW's second moment (``exp_avg_sq``) is stored in (Megatron's
    ``--exp-avg-sq-dtype``), as ``exp_avg_dtype``."""
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """The dtype of the master weights the optimizer keeps beside 16-bit parameters
    (Megatron's ``--main-params-dtype``, fp32 or fp16, under the precision-aware
    optimizer); no effect where the parameters are the master (fp32 training,
    ``master_weights: parameters``)."""
    param_remainders: bool = False
    """fp32 master weights stored as the 16 low bits each (an int16 remainder), the high 16
    being the bf16 parameter itself: 2 bytes a parameter where fp32 master weights take 4
    (Transformer Engine's FusedAdam ``store_param_remainders``, which Megatron-Core turns on
    by default, ``OptimizerConfig.store_param_remainders``, when the precision-aware
    optimizer owns fp32 master weights of bf16 parameters: no FP8 or delayed scaling,
    megatron/core/optimizer/__init__.py). Needs bf16 training and fp32 main params."""

    fp8: FP8Recipe | Literal["none"] = "none"
    """The linear layers' GEMMs in FP8 under this recipe (Transformer Engine's
    ``fp8_autocast``; Megatron's ``--fp8-format hybrid --fp8-recipe``): ``delayed``,
    ``current``, ``blockwise`` (DeepSeek-V3's tile-wise scaling) or ``mxfp8`` (Blackwell);
    ``none``: every GEMM in the training dtype. E4M3 forward, E5M2 for gradients (the hybrid
    format); attention, norms, softmax, the loss, the output layer, gradients' reductions,
    master weights and the optimizer stay as without it (docs/model.md, FP8). The system's
    GPU must list the recipe in ``gpu.fp8_recipes``."""
    fp8_weight_cast: Literal["step", "microbatch"] = "step"
    """How often FP8 linears cast their weights: once per ``step`` (Transformer Engine's
    cached weight workspace, renewed when ``is_first_microbatch`` is true, which Megatron
    Core passes: core/pipeline_parallel/schedules.py ``set_is_first_microbatch``), or every
    ``microbatch`` (a caller that passes no ``is_first_microbatch``, as Composer's modules:
    transformer_engine/pytorch/module/linear.py ``update_ws``), the column-wise copy then
    kept for the backward with the activations."""
    fp8_cache: Literal["linear_inputs", "deepseek"] = "linear_inputs"
    """What FP8 linears keep for the backward (with ``fp8`` only): ``linear_inputs``, each
    FP8 linear its input's FP8 copy (1 byte; Transformer Engine's ``_Linear`` saves the
    quantized input), the other kept tensors in the training dtype; ``deepseek``,
    DeepSeek-V3's low-precision activations (arXiv:2412.19437, §3.3.3) besides: the input of
    the linear after the attention in the customised E5M6 format (12 bits packed: 1.5
    bytes), kept once for both the linear's and the attention's backward, and the routed
    experts' SwiGLU inputs in FP8 (1 byte; recompute the SwiGLU output with
    ``parallel.recompute_modules: [moe_act]``)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict) and "preset" not in data and "name" not in data:
            data = {"preset": DEFAULT_STACK, **data}  # overrides of the default stack
        if isinstance(data, dict) and data.get("preset") is not None:
            data = {**preset_fields(data["preset"]), **data}
        if isinstance(data, dict) and isinstance(data.get("fusions"), list):
            data = {**data, "fusions": tuple(data["fusions"])}  # YAML lists; strict tuples
        return data

    def fused(self, what: Fusion) -> bool:
        return what in self.fusions

    @property
    def flash(self) -> bool:
        return self.attention in (*get_args(FusedAttention), "te")

    @property
    def norm_classes(self) -> tuple[str, str]:
        """The cost classes of a norm and of its γ/β gradient sums (``norm_kernel``)."""
        return ("norm", "norm") if self.norm_kernel == "torch" else ("elementwise", "reduction")

    @property
    def host_us(self) -> float:
        """Host time per kernel launch: none when a CUDA graph replays the step."""
        return 0.0 if self.cuda_graphs else self.host_overhead_us

    def amp(self, dtype_bytes: int) -> bool:
        """Autocast's mixed precision applies: the stack says so and the training dtype
        is a 16-bit one."""
        return self.autocast and dtype_bytes < 4

    def fp32_under_amp(self, dtype_bytes: int) -> int:
        """Bytes of an element autocast keeps in fp32 (norms, the residual stream, the
        embedding table, the loss): 4 under autocast, else the training dtype's."""
        return 4 if self.amp(dtype_bytes) else dtype_bytes

    def fp32_params(self, dtype_bytes: int) -> bool:
        """The parameters are fp32 and are the master copy under 16-bit training:
        autocast's, or a stack that keeps its master weights in the parameters."""
        return self.amp(dtype_bytes) or (dtype_bytes < 4 and self.master_weights == "parameters")

    def fused_main_grads(self, dtype_bytes: int) -> bool:
        """The wgrad GEMMs read-modify-write an fp32 main grad in their epilogue (Megatron's
        gradient_accumulation_fusion): fp32 main grads, except where the fp32 parameters
        are the master under 16-bit training (FSDP mixed precision), whose compute copies'
        gradients are 16-bit as the GEMM writes them and FSDP casts, reduces and
        accumulates them (:func:`simulator.model.inventory.sharding.fsdp_reduce_parts`)."""
        return self.main_grads == "fp32" and not (
            dtype_bytes < 4 and self.master_weights == "parameters")

    def main_grad_bytes(self, dtype_bytes: int) -> int:
        return 4 if self.main_grads == "fp32" else dtype_bytes

    def master_bytes(self, dtype_bytes: int) -> float:
        """Bytes of the optimizer's master copy of one parameter: none where the
        parameters are the master (fp32 ones), 2 as int16 remainders or fp16, else 4."""
        if dtype_bytes == 4 or self.fp32_params(dtype_bytes):
            return 0.0
        return 2.0 if self.param_remainders else float(STATE_BYTES[self.main_params_dtype])

    def optimizer_bytes(self, dtype_bytes: int) -> float:
        """AdamW's state per parameter: the master copy and the two moments (12 bytes with
        fp32 master weights and moments; 8 where the fp32 parameters are the master)."""
        return self.master_bytes(dtype_bytes) + STATE_BYTES[self.exp_avg_dtype] \
            + STATE_BYTES[self.exp_avg_sq_dtype]

    def reduce_bytes(self, dtype_bytes: int) -> int:
        return 4 if self.grad_reduce_dtype == "fp32" else dtype_bytes

    def overlap(self, requested: OverlapSpec) -> OverlapSpec:
        """What overlaps under this stack: a blocking send or an after-backward
        reduction is in line whatever ``parallel.overlap`` asks for."""
        return requested.model_copy(update={
            "pp": requested.pp and self.pipeline_send == "async",
            "dp": requested.dp and self.grad_reduce == "overlapped"})


def preset_stack_names() -> list[str]:
    return sorted(p.stem for p in STACKS_DIR.glob("*.yaml"))


def preset_fields(name: object) -> dict[str, Any]:
    if not isinstance(name, str) or not (STACKS_DIR / f"{name}.yaml").exists():
        near = difflib.get_close_matches(str(name), preset_stack_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ValueError(f"unknown stack preset; {hint}bundled: "
                         f"{', '.join(preset_stack_names())}")
    data = read_yaml(STACKS_DIR / f"{name}.yaml", "stack.preset")
    assert isinstance(data, dict), f"stack preset {name} is not a mapping"
    return data


def load_stack(name: str) -> StackSpec:
    """A bundled preset by name."""
    return StackSpec.model_validate({"preset": name})


@lru_cache(maxsize=1)
def default_stack() -> StackSpec:
    return load_stack(DEFAULT_STACK)
