"""What a GPU process holds besides tensors, as profile data: the CUDA context, cuBLAS's
workspaces and NCCL's channels (priced in :mod:`simulator.model.device_memory`)."""

from __future__ import annotations

from pydantic import Field

from simulator.system.units import Frozen


class RuntimeMemory(Frozen):
    """What the GPU holds per process besides tensors (simulator/model/device_memory.py);
    the defaults are an H100's, a preset states its own with the source."""

    # the CUDA context with lazy module loading, 1e9 bytes: "around 400MB if CUDA >= 11.7
    # is used and lazy module loading enabled" (pytorch/pytorch#109888)
    context_GB: float = Field(default=0.4, ge=0, le=1e3)
    # cuBLAS workspace per handle and stream, MiB (PyTorch CublasHandlePool.cpp
    # getChosenWorkspaceSize: 32 on Hopper and Blackwell, 8.125 before)
    cublas_workspace_MiB: float = Field(default=32.0, ge=0, le=1e5)
    gemm_streams: int = Field(default=1, ge=0, le=64)  # streams that run GEMMs
    # channels NCCL's topology search gives a communicator (its INIT log's "coll channels");
    # 0: no NCCL (a CPU profile's gloo)
    nccl_channels: int = Field(default=16, ge=0, le=64)


#: a CPU process's: no CUDA context, cuBLAS workspace or NCCL
NO_RUNTIME = RuntimeMemory(context_GB=0.0, cublas_workspace_MiB=0.0, gemm_streams=0,
                           nccl_channels=0)
