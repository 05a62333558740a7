"""What a profiler event is: the classes a real job's trace is cut into, and how each
maps onto the simulator's.

Classes, in table order (:data:`CLASSES`):

- compute: ``gemm``, ``attention`` (flash, fmha, cuDNN SDPA, memory-efficient and the
  CPU's SDPA), ``norm`` (layer, RMS, batch and group norms) and ``elementwise``
  (every other kernel: pointwise, reductions, softmax, loss, optimizer, copies);
- communication, one class per collective kind (:data:`COMM_CLASSES`):
  ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send_recv``, ``all_to_all``
  and ``other_comm`` (broadcast, reduce, a functional collective's wait);
- ``memcpy``: the device's copies and memsets (``gpu_memcpy``/``gpu_memset``).

A GPU kernel is communication when its name is NCCL's (HolisticTraceAnalysis
``hta/common/types.py``: ``CommunicateKernelGroupingPattern``, ``^nccl`` and
``ncclKernel``; NCCL 2.19+ names them ``ncclDevKernel_*``); its kind is the trace's
``Collective name`` argument where the profiler records it (PyTorch ≥ 2.1), else the
kernel's name (NCCL runs all-to-all as ``SendRecv`` kernels: only the argument tells).
On a CPU trace the same names mark the c10d/gloo ops (``c10d::allreduce_``,
``gloo:all_reduce``, ``_c10d_functional::wait_tensor``); ``aten::`` operators are never
communication (``aten::broadcast_tensors`` is compute).

The simulator's side (:data:`COST_CLASS_TRACE`): the op inventory's cost classes fold
into the compute classes (GEMM passes into ``gemm``, the attention kernels into
``attention``, ``norm`` into ``norm``, everything memory-bound into ``elementwise``);
the optimizer step is ``elementwise`` (fused/foreach Adam kernels); a collective's kind
is its op's (``tp.all_reduce`` → ``all_reduce``, ``pp.send`` → ``send_recv``); an
offload transfer is ``memcpy``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from simulator.system.units import COST_CLASSES

COMPUTE_CLASSES = ("gemm", "attention", "norm", "elementwise")
COMM_CLASSES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all",
                "other_comm")
MEMCPY = "memcpy"
CLASSES = (*COMPUTE_CLASSES, *COMM_CLASSES, MEMCPY)
#: Per-rank figures beside the classes: busy unions, what overlap leaves, the step.
SUMMARY = ("compute", "comm", "exposed_comm", "idle", "step")

#: Communication by name (any case): NCCL kernels, c10d/gloo/functional-collective ops.
COMM_PATTERN = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|send|recv|broadcast|wait_tensor",
    re.IGNORECASE,
)
NCCL_KERNEL = re.compile(r"^nccl|ncclKernel|ncclDevKernel")

#: A collective's kind from its name or ``Collective name``; first match wins.
COMM_KIND_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(rx, re.IGNORECASE)) for kind, rx in (
        ("reduce_scatter", r"reduce_?scatter"),
        ("all_reduce", r"all_?reduce"),
        ("all_gather", r"all_?gather"),
        ("all_to_all", r"all_?to_?all"),
        ("send_recv", r"send|recv"),
    ))

#: GPU kernels by name (any case); first match wins, the rest are ``elementwise``.
KERNEL_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cls, re.compile(rx, re.IGNORECASE)) for cls, rx in (
        ("attention", r"flash|fmha|sdpa|attention|_attn|mha_"),
        ("gemm", r"gemm|cublas|cutlass|nvjet|xmma|wgmma|matmul|s16816|h884|splitk"),
        ("norm", r"(layer|rms|group|batch|instance)_?norm|ln_(fwd|bwd)"),
    ))

#: CPU operators by name; an op none of these names takes its parent's class
#: (``aten::t`` inside ``aten::linear`` is GEMM time), or ``elementwise`` at the top.
CPU_OP_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cls, re.compile(rx, re.IGNORECASE)) for cls, rx in (
        ("attention", r"scaled_dot_product|flash_attention|efficient_attention|_attention"),
        ("gemm", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_scaled_mm)$"
                 r"|^(addmm|mm|bmm|baddbmm|mv)backward"),
        ("norm", r"(layer|rms|group|batch|instance)_?norm"),
    ))

#: The op inventory's cost classes as trace classes (every cost class maps).
COST_CLASS_TRACE: Mapping[str, str] = {
    c: ("gemm" if c.startswith("gemm_") else "attention" if c.startswith("attention_")
        else "norm" if c == "norm" else "elementwise") for c in COST_CLASSES}

#: A simulated communication kind whose spans are copies, not collectives.
SIMULATED_MEMCPY_KINDS = frozenset({"offload"})


def comm_kind(text: str) -> str:
    """The collective kind a name or ``Collective name`` says; ``other_comm`` if none."""
    return next((kind for kind, rx in COMM_KIND_RULES if rx.search(text)), "other_comm")


def is_comm_name(name: str) -> bool:
    """A CPU trace's communication op (never an ``aten::`` operator)."""
    return not name.startswith("aten::") and COMM_PATTERN.search(name) is not None


def kernel_class(name: str, collective: str | None = None) -> str:
    """The class of a GPU kernel; ``collective`` is its ``Collective name`` argument."""
    if NCCL_KERNEL.search(name):
        return comm_kind(collective or name)
    if name.startswith(("Memcpy", "Memset")):
        return MEMCPY
    return next((cls for cls, rx in KERNEL_RULES if rx.search(name)), "elementwise")


def cpu_op_class(name: str) -> str | None:
    """The class a CPU operator's own name says, or None (it takes its parent's)."""
    if is_comm_name(name):
        return comm_kind(name)
    return next((cls for cls, rx in CPU_OP_RULES if rx.search(name)), None)
