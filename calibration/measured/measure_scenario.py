"""The simulator scenario of a measured run (``scenario.yaml``).

Written in the layout of hand-written scenarios, one flow mapping per section,
so that ``clustersim compare`` simulates exactly what ran: the ``pytorch-eager``
stack (the kernels plain PyTorch eager launches), one device per rank on one node,
the GPT-2 model features of :mod:`calibration.measured.gpt`, fp32 on CPU and bf16
(autocast) on CUDA.  No torch here unless a CUDA name must be looked up.
"""

from __future__ import annotations

import re
from typing import Any

from calibration.measured.measure_config import MeasureConfig
from simulator.system.devices import preset_for

#: The software stack every measured run executes (simulator/presets/stacks/pytorch-eager.yaml).
STACK = "pytorch-eager"


def stack_for(device: str) -> str | dict[str, str | bool]:
    """The run's stack: :data:`STACK`, whose optimizer is AdamW's for-loop as it runs on
    CPU tensors, in fp32. On CUDA the same ``torch.optim.AdamW(params, lr=...)`` runs its
    foreach (multi-tensor) implementation (``torch/optim/optimizer.py``
    ``_default_to_fused_or_foreach`` picks foreach when every parameter is on a CUDA
    device and neither ``foreach`` nor ``fused`` is given; the profiler shows
    ``multi_tensor_apply_kernel``), and the step runs under bf16 ``torch.autocast`` over
    fp32 parameters (:func:`calibration.measured.worker_run.autocast_for`)."""
    if device == "cpu":
        return STACK
    return {"preset": STACK, "optimizer": "foreach", "autocast": True}


def _flow(mapping: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return _flow(v) if isinstance(v, dict) else str(v)

    return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in mapping.items()) + "}"


def system_name(cfg: MeasureConfig, device_name: str | None = None) -> str:
    """The system preset the scenario names: ``cpu-<threads>thread`` or the GPU's DGX preset
    (:func:`simulator.system.devices.preset_for`).

    An unknown GPU gets a slug of its name; point ``cluster.system`` at a
    calibrated profile YAML before comparing.
    """
    if cfg.device == "cpu":
        return f"cpu-{cfg.threads}thread"
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name(0)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return preset_for(device_name) or slug


def scenario_name(cfg: MeasureConfig) -> str:
    name = f"measured-tp{cfg.tp}-pp{cfg.pp}-dp{cfg.dp}-{cfg.schedule}"
    if cfg.zero:
        name += f"-zero{cfg.zero}"
    if cfg.powersgd_rank:
        name += f"-powersgd{cfg.powersgd_rank}"
    if cfg.experts:
        name += f"-moe{cfg.experts}-ep{cfg.ep}"
    if cfg.cp > 1:
        name += f"-cp{cfg.cp}"
    if cfg.slow_rank >= 0:
        name += f"-slow{cfg.slow_rank}x{cfg.slowdown:g}"
    return name + ("-sp" if cfg.sequence_parallel else "")


def scenario_dict(
    cfg: MeasureConfig, device_name: str | None = None
) -> dict[str, dict[str, Any] | str]:
    """The simulator scenario equivalent to the run (one device per rank, one node)."""
    out: dict[str, dict[str, Any] | str] = {
        "name": scenario_name(cfg),
        # what calibration/measured/gpt.py runs: separate q/k/v, SDPA, DDP / FSDP2 /
        # torch.distributed.pipelining / DTensor TP, torch.optim.AdamW (the preset's comments)
        "stack": stack_for(cfg.device),
        "model": _model_section(cfg.model),
        "cluster": {
            "system": system_name(cfg, device_name),
            "nodes": 1,
            "gpus_per_node": cfg.world_size,
        },
        "parallel": {
            "tp": cfg.tp,
            "pp": cfg.pp,
            "dp": cfg.dp,
            "schedule": cfg.schedule,
            "virtual_stages": cfg.virtual_stages,
            "zero": cfg.zero,
            "recompute": "none",
            "sequence_parallel": cfg.sequence_parallel,
        },
        "training": _training_section(cfg),
    }
    _variants_into(out, cfg)
    return out


def _model_section(m: dict[str, Any]) -> dict[str, Any]:
    """The measured GPT's sizes with the features :mod:`calibration.measured.gpt` builds:
    GPT-2's block, or Llama's (:mod:`calibration.measured.llama`), the head tied either way."""
    llama = m.get("arch") == "llama"
    return {
        "layers": m["layers"],
        "hidden": m["hidden"],
        "heads": m["heads"],
        "kv_heads": m.get("kv_heads", m["heads"]),
        "ffn_hidden": m["ffn_hidden"],
        "vocab": m["vocab"],
        "seq_len": m["seq_len"],
        "activation": "swiglu" if llama else "gelu",
        "norm": "rmsnorm" if llama else "layernorm",
        "bias": not llama,
        "tied_embeddings": True,
        "position": "rope" if llama else "learned",
    }


def _training_section(cfg: MeasureConfig) -> dict[str, Any]:
    training: dict[str, Any] = {
        "global_batch": cfg.micro_batch_size * cfg.micro_batches * cfg.dp,
        "micro_batch": cfg.micro_batch_size,
        "dtype": "bf16" if cfg.device == "cuda" else "fp32",
    }
    if cfg.powersgd_rank:  # the hook compresses from step `warmup`: the timed steps
        training["gradient_compression"] = {"method": "powersgd", "rank": cfg.powersgd_rank,
                                            "start_step": cfg.warmup}
    return training


def _variants_into(out: dict[str, dict[str, Any] | str], cfg: MeasureConfig) -> None:
    """What the MoE, CP, PowerSGD and straggler runs change in the scenario."""
    model, parallel = out["model"], out["parallel"]
    assert isinstance(model, dict) and isinstance(parallel, dict)
    if cfg.experts:  # calibration/measured/moe_worker.py: padded buffers, one dense reduction
        model.update(experts=cfg.experts, experts_per_token=cfg.experts_per_token,
                     expert_ffn_hidden=cfg.model["ffn_hidden"],
                     capacity_factor=cfg.capacity_factor)
        parallel.update(ep=cfg.ep, dp_bucket_MB=1e6)
        # no DDP: MoETrainer.reduce concatenates the dense gradients after the backward,
        # all-reduces them in one call, divides and copies them back (the DDP bucket's
        # copy in and out), so one bucket, after the backward, no 1 MiB first bucket
        stack = out["stack"]
        out["stack"] = {**({"preset": stack} if isinstance(stack, str) else stack),
                        "grad_reduce": "after_backward", "ddp_first_bucket_MB": 0}
    if cfg.cp > 1:  # calibration/measured/cp_worker.py: K and V all-gathered, DDP over dp·cp
        parallel.update(cp=cfg.cp, cp_comm_type="allgather")
    if cfg.powersgd_rank:
        from calibration.measured.compression_hook import POWERSGD_BUCKET_MB

        parallel["dp_bucket_MB"] = POWERSGD_BUCKET_MB
    if cfg.slow_rank >= 0:  # calibration/measured/slow_rank.py: one straggler on purpose
        out["variability"] = {"slow_gpus": [{"ranks": [cfg.slow_rank],
                                             "compute_slowdown": cfg.slowdown}]}


def scenario_yaml(cfg: MeasureConfig, device_name: str | None = None) -> str:
    """``scenario.yaml`` text: one flow mapping per section, as hand-written scenarios are."""
    lines = []
    for key, value in scenario_dict(cfg, device_name).items():
        lines.append(f"{key}: {_flow(value) if isinstance(value, dict) else value}")
    return "\n".join(lines) + "\n"
