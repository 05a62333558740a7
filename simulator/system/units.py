"""The vocabulary of a hardware profile: dtypes, link and collective names, cost
classes, the terms calibration fits, and the physical ranges every number must lie in
(wide enough for any real device, from a CPU thread to a future accelerator, narrow
enough that products and quotients stay finite).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Dtype = Literal["bf16", "fp16", "fp32"]


#: The element types a GPU may quote a dense tensor-core peak for (``gpu.peak_tflops``):
#: the training dtypes and fp8 (E4M3 / E5M2, Hopper and later), which only the GEMMs of a
#: stack with ``stack.fp8`` run in.
PeakDtype = Literal["bf16", "fp16", "fp32", "fp8"]


#: FP8 training recipes (``stack.fp8``, ``gpu.fp8_recipes``), as Transformer Engine names
#: them (transformer_engine/common/recipe/__init__.py): ``delayed`` (DelayedScaling: a
#: per-tensor scale from an amax history, updated once per pass), ``current``
#: (Float8CurrentScaling: a per-tensor amax pass before every cast), ``blockwise``
#: (Float8BlockScaling, DeepSeek-V3's tile-wise FP8: 1x128 activation tiles, 128x128
#: weight blocks, an fp32 scale each), ``mxfp8`` (MXFP8BlockScaling: blocks of 32 with an
#: E8M0 scale, Blackwell's tensor cores).
FP8Recipe = Literal["delayed", "current", "blockwise", "mxfp8"]


LinkName = Literal["intra_node", "inter_node"]


#: What a transfer's time depends on: a GPU's NVSwitch port, its NIC, the fabric core.
LinkClass = Literal["intra_node", "inter_node", "core"]


CollectiveName = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv",
                         "all_to_all"]


#: The collectives DTensor's redistributions issue (``gpu.funcol_host``).
FuncolKind = Literal["all_reduce", "all_gather", "reduce_scatter"]


#: The fused attention kernels a stack may run (``stack.attention``) and a profile may
#: price on their own measured curves (``gpu.attention_kernels``): FlashAttention-2,
#: FlashAttention-3 (Hopper), cuDNN's fused attention (Transformer Engine's
#: FusedAttention, PyTorch's SDPA cuDNN backend), FlashAttention (v1, flash-attn 1.x) and
#: FlashAttention in Triton (flash-attn's ``flash_attn_triton.py``, llm-foundry's
#: ``attn_impl: triton`` before 2024).
FusedAttention = Literal["flash2", "flash3", "cudnn", "flash1", "flash_triton"]


# Physical ranges: wide enough for any real device (a CPU thread to a future
# accelerator), narrow enough that products and quotients stay finite.
RATE = Field(ge=1e-6, le=1e12)  # GB/s, Gb/s or TFLOP/s (1e12: "free" for what-ifs)


TIME_US = Field(ge=0, le=1e7)  # microseconds (10 s)


MIN_EFFICIENCY = 1e-4  # the slowest a curve may say: a calibration's fit floors its knots here


EFFICIENCY = Field(ge=MIN_EFFICIENCY, le=1)  # achieved / peak


Rate = Annotated[float, RATE]


#: The op inventory's cost classes: GEMMs and attention are sized by the FLOPs of
#: one call, the memory-bound classes by the bytes one kernel moves.
CostClass = Literal["gemm_fwd", "gemm_dgrad", "gemm_wgrad", "attention_fwd", "attention_bwd",
                    "softmax", "cross_entropy", "elementwise", "norm", "reduction", "copy",
                    "optimizer"]


COST_CLASSES: tuple[str, ...] = get_args(CostClass)


LINK_NAMES: tuple[str, ...] = get_args(LinkName)


#: The terms calibration fits and whose relative spread a profile may record.
UNCERTAINTY_TERMS: tuple[str, ...] = ("gemm", "attention", "memory", *COST_CLASSES,
                                      "kernel_overhead", *LINK_NAMES, "interference",
                                      "collective_sync", "send_sync", "funcol_host",
                                      "funcol_sync", "rank_spread")


#: A factor by which overlapped communication slows compute (1 = not at all).
Interference = Annotated[float, Field(ge=1, le=10)]


#: A relative standard deviation (σ / mean).
RelativeStd = Annotated[float, Field(ge=0, le=1)]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
