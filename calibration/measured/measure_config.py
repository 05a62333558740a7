"""Configuration of a measured run: what ``clustersim measure`` validates and the worker reads.

:class:`MeasureConfig` travels from :func:`calibration.measured.measure.run_measure` to
every torchrun worker as JSON.  :func:`validate` rejects a run that cannot work
before anything launches, with one line naming the field, its value and the
fix.  No torch here (the CUDA device count is looked up lazily).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibration.measured.gpt_presets import ARCHES, MODEL_KEYS, OPTIONAL_KEYS, PRESETS

SCHEDULES = ("gpipe", "1f1b", "interleaved")
DEVICES = ("cpu", "cuda")
#: Stages per pipeline rank of each schedule (interleaved runs two chunks per rank).
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
DEFAULT_TIMEOUT_S = 600.0


class MeasureError(RuntimeError):
    """A measured run failed: a worker crashed, the launch timed out, or no result came back."""


@dataclass(frozen=True)
class MeasureConfig:
    """One measured run; the worker reads it back from JSON."""

    tp: int  # tensor-parallel degree
    pp: int  # pipeline stages (ranks)
    dp: int  # data-parallel replicas
    schedule: str  # gpipe | 1f1b | interleaved (used when pp > 1)
    zero: int  # 0: DDP-style replication, 3: FSDP2 fully_shard
    micro_batches: int  # micro-batches per step per replica
    micro_batch_size: int  # samples per micro-batch
    model: dict[str, Any]  # GPTConfig sizes (and arch, kv_heads where given)
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    device: str  # cpu | cuda
    threads: int  # torch threads per process
    out_dir: str  # where results go
    timeout_s: float = DEFAULT_TIMEOUT_S  # launch timeout; also the process-group timeout
    sequence_parallel: bool = False  # Megatron sequence parallelism with TP
    seed: int = 1234  # model init and synthetic data
    virtual_stages: int = field(default=1)  # model chunks per pipeline rank
    powersgd_rank: int = 0  # > 0: PowerSGD DDP hook of this rank, from step `warmup` on
    experts: int = 0  # > 0: every MLP is this many routed experts (calibration/measured/moe_worker)
    ep: int = 1  # expert-parallel degree (carved out of dp)
    experts_per_token: int = 2  # top-k routing
    capacity_factor: float = 1.0  # each expert's buffer: capacity_factor * k * tokens / experts
    cp: int = 1  # context-parallel degree: the sequence split (calibration/measured/cp_worker)
    slow_rank: int = -1  # >= 0: this rank's compute takes `slowdown` times as long
    slowdown: float = 1.0  # (calibration/measured/slow_rank.py)
    min_seconds: float = 0.0  # > 0: time more than `steps` until they span this long

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def resolve_model(
    model: dict[str, Any] | str, overrides: dict[str, int | None] | None = None
) -> dict[str, Any]:
    """Sizes of a preset name (``tiny-gpt``) or a dict, then the non-``None`` overrides.

    Overriding ``hidden`` without ``ffn_hidden`` keeps the MLP at 4 x hidden.
    """
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model={model!r}: unknown preset; choose one of {sorted(PRESETS)}")
        sizes = dict(PRESETS[model])
    else:
        sizes = dict(model)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    sizes.update(given)
    if "hidden" in sizes and ("ffn_hidden" not in sizes or "hidden" in given):
        sizes["ffn_hidden"] = given.get("ffn_hidden", 4 * sizes["hidden"])
    return sizes


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate(cfg: MeasureConfig) -> None:
    """Raise ``ValueError("field=value: problem; fix")`` for a run that cannot work."""
    _run_problems(cfg)
    _model_problems(cfg)
    if cfg.powersgd_rank:
        _powersgd_problems(cfg)
    if cfg.experts or cfg.ep > 1:
        _moe_problems(cfg)
    if cfg.cp != 1:
        _cp_problems(cfg)
    if cfg.slow_rank >= 0 or cfg.slowdown != 1.0:
        _slow_rank_problems(cfg)
    _pipeline_problems(cfg)
    if cfg.device == "cuda":
        available = _cuda_device_count()
        _require(
            cfg.world_size <= available,
            f"tp*pp*dp*cp={cfg.world_size}: only {available} CUDA device(s) here; "
            "lower the degrees",
        )
    _memory_problems(cfg)


#: bytes a trained parameter holds at the least: fp32 weight, gradient, AdamW's two moments
STATE_BYTES_PER_PARAM = 16


def state_bytes(cfg: MeasureConfig) -> tuple[int, int]:
    """(parameters, bytes) a lower bound of what the run's parameter state takes on the
    host (CPU) or on one device (CUDA): the matrices alone (no biases, norms, positions
    or activations) at :data:`STATE_BYTES_PER_PARAM`, split over tp · pp, and over dp
    under ZeRO-3; every rank of a CPU run shares the host."""
    m = cfg.model
    h, f, layers, vocab = m["hidden"], m["ffn_hidden"], m["layers"], m["vocab"]
    kv_width = h * m.get("kv_heads", m["heads"]) // m["heads"]
    mlp = 3 if m.get("arch") == "llama" else 2  # SwiGLU's gate, up and down
    params = layers * (2 * h * h + 2 * h * kv_width + mlp * h * f) + vocab * h
    per_rank = STATE_BYTES_PER_PARAM * params // (cfg.tp * cfg.pp * (cfg.dp if cfg.zero else 1))
    return params, per_rank * (cfg.world_size if cfg.device == "cpu" else 1)


def _memory_problems(cfg: MeasureConfig) -> None:
    """Refuse, before torchrun starts, a model whose parameter state alone cannot fit:
    without this the workers start, fail to allocate and the run exits 1."""
    params, need = state_bytes(cfg)
    have = _available_bytes(cfg.device)
    where = "this host's available memory" if cfg.device == "cpu" else "one CUDA device"
    _require(have is None or need <= have,
             f"model={cfg.model}: at least {need / 1e9:,.1f} GB of fp32 weights, gradients "
             f"and AdamW states ({params:,} parameters), more than {where} "
             f"({(have or 0) / 1e9:,.1f} GB); lower --layers, --hidden or --vocab")


def _available_bytes(device: str) -> int | None:
    """MemAvailable of /proc/meminfo (CPU) or device 0's total memory (CUDA); None where
    unknown."""
    if device == "cuda":
        try:
            import torch
        except ImportError:
            return None
        return int(torch.cuda.get_device_properties(0).total_memory) \
            if torch.cuda.is_available() else None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _run_problems(cfg: MeasureConfig) -> None:
    """The degrees, counts, schedule, ZeRO stage, device and timeout."""
    for name in ("tp", "pp", "dp", "micro_batches", "micro_batch_size", "steps", "threads"):
        value = getattr(cfg, name)
        _require(
            isinstance(value, int) and value >= 1, f"{name}={value!r}: must be an integer >= 1"
        )
    _require(cfg.warmup >= 0, f"warmup={cfg.warmup}: must be >= 0")
    _require(
        isinstance(cfg.min_seconds, (int, float)) and 0 <= cfg.min_seconds < cfg.timeout_s,
        f"min_seconds={cfg.min_seconds!r}: must be >= 0 and below the timeout "
        f"({cfg.timeout_s:g} s); use 0 to time exactly the given steps",
    )
    _require(
        cfg.schedule in SCHEDULES,
        f"schedule={cfg.schedule!r}: choose one of {', '.join(SCHEDULES)}",
    )
    _require(cfg.zero in (0, 3), f"zero={cfg.zero}: choose 0 (DDP) or 3 (FSDP2 fully_shard)")
    _require(cfg.device in DEVICES, f"device={cfg.device!r}: choose cpu or cuda")
    _require(cfg.timeout_s > 0, f"timeout={cfg.timeout_s}: must be > 0 seconds")


def _model_problems(cfg: MeasureConfig) -> None:
    """The model's sizes, and their divisibility by the TP degree (and sequence parallel)."""
    m = cfg.model
    allowed = (*MODEL_KEYS, *OPTIONAL_KEYS)
    unknown = sorted(set(m) - set(allowed))
    _require(not unknown, f"model: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    for key in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
        _require(
            isinstance(m.get(key), int) and m[key] >= 1,
            f"model.{key}={m.get(key)!r}: must be an integer >= 1",
        )
    _require(
        m["hidden"] % m["heads"] == 0,
        f"model.hidden={m['hidden']}: not divisible by heads={m['heads']}; use a multiple",
    )
    _arch_problems(cfg)
    for key in ("heads", "hidden", "ffn_hidden", "vocab", "kv_heads"):
        _require(
            m.get(key, cfg.tp) % cfg.tp == 0,
            f"model.{key}={m.get(key)}: not divisible by tp={cfg.tp}; "
            "use a multiple of tp or a smaller tp",
        )
    if cfg.sequence_parallel:
        _require(cfg.tp > 1, "sequence_parallel=true: needs tp > 1")
        _require(
            m["seq_len"] % cfg.tp == 0,
            f"model.seq_len={m['seq_len']}: not divisible by tp={cfg.tp} (sequence parallel)",
        )


def _arch_problems(cfg: MeasureConfig) -> None:
    """Llama's block (``arch``) and grouped-query attention (``kv_heads``): the dense
    trainer only (the MoE and CP workers build GPT-2's blocks)."""
    m = cfg.model
    arch, kv = m.get("arch", "gpt"), m.get("kv_heads", m["heads"])
    _require(arch in ARCHES, f"model.arch={arch!r}: choose one of {', '.join(ARCHES)}")
    _require(isinstance(kv, int) and kv >= 1 and m["heads"] % kv == 0,
             f"model.kv_heads={kv!r}: must divide heads={m['heads']}; use a divisor")
    _require(kv == m["heads"] or arch == "llama",
             f"model.kv_heads={kv}: grouped-query attention needs arch llama "
             "(--model tiny-llama or llama-1b); or leave kv_heads out")
    _require(arch == "gpt" or (cfg.experts == 0 and cfg.cp == 1),
             f"model.arch={arch}: the MoE and context-parallel runs build GPT-2's "
             "blocks; use --model tiny-gpt or small-gpt with --experts or --cp")


def _powersgd_problems(cfg: MeasureConfig) -> None:
    """PowerSGD is a DDP hook that PyTorch starts after at least two steps."""
    _require(cfg.powersgd_rank >= 1, f"powersgd_rank={cfg.powersgd_rank}: must be >= 1")
    _require(
        cfg.dp > 1 and cfg.zero == 0 and cfg.tp == 1,
        f"powersgd_rank={cfg.powersgd_rank}: PowerSGD is a DDP hook; needs dp > 1, "
        f"zero 0 and tp 1 (got dp={cfg.dp}, zero={cfg.zero}, tp={cfg.tp})",
    )
    _require(
        cfg.warmup >= 2,
        f"warmup={cfg.warmup}: PowerSGD starts after the warm-up steps and PyTorch "
        "needs at least 2; use --warmup 2 or more",
    )


def _slow_rank_problems(cfg: MeasureConfig) -> None:
    """The straggler is one rank of the dense worker, slowed 1 to 100 times."""
    _require(0 <= cfg.slow_rank < cfg.world_size,
             f"slow_rank={cfg.slow_rank}: name a rank 0..{cfg.world_size - 1} "
             "(--slow-rank R with --slowdown K)")
    _require(1.0 <= cfg.slowdown <= 100.0,
             f"slowdown={cfg.slowdown}: must lie in [1, 100] (K times as long)")
    _require(not cfg.experts and cfg.cp == 1,
             f"slow_rank={cfg.slow_rank}: the straggler option is in the dense TP/PP/DP "
             "worker only; use it without --experts and --cp")


def _pipeline_problems(cfg: MeasureConfig) -> None:
    """The layers cut evenly into stages, and the micro-batches each schedule needs."""
    m = cfg.model
    stages = cfg.pp * cfg.virtual_stages
    _require(
        m["layers"] % stages == 0,
        f"model.layers={m['layers']}: not divisible by pp*virtual_stages={stages}; use a multiple",
    )
    if cfg.pp > 1 and cfg.schedule == "1f1b":
        _require(
            cfg.micro_batches >= cfg.pp,
            f"micro_batches={cfg.micro_batches}: 1f1b needs >= pp={cfg.pp}",
        )
    if cfg.schedule == "interleaved":
        _require(cfg.pp > 1, "schedule=interleaved: needs pp >= 2")
        rounds = max(1, cfg.micro_batches // cfg.pp)
        _require(
            cfg.micro_batches % rounds == 0,
            f"micro_batches={cfg.micro_batches}: interleaved needs a multiple of "
            f"pp={cfg.pp} (or fewer than pp)",
        )


def _moe_problems(cfg: MeasureConfig) -> None:
    """The MoE worker runs experts over EP ranks carved out of dp, without TP, PP or ZeRO."""
    _require(cfg.experts >= 2, f"ep={cfg.ep}: needs experts >= 2 (got {cfg.experts})")
    _require(
        cfg.tp == 1 and cfg.pp == 1 and cfg.zero == 0 and not cfg.powersgd_rank,
        f"experts={cfg.experts}: the MoE run has expert and data parallelism only; use tp 1, "
        "pp 1, zero 0 and no PowerSGD",
    )
    _require(
        cfg.ep >= 1 and cfg.dp % cfg.ep == 0 and cfg.experts % cfg.ep == 0,
        f"ep={cfg.ep}: must divide dp ({cfg.dp}) and experts ({cfg.experts})",
    )
    _require(
        1 <= cfg.experts_per_token <= cfg.experts,
        f"experts_per_token={cfg.experts_per_token}: use 1 to experts ({cfg.experts})",
    )
    _require(cfg.capacity_factor > 0, f"capacity_factor={cfg.capacity_factor}: must be > 0")


def _cp_problems(cfg: MeasureConfig) -> None:
    """The CP worker splits the sequence over cp ranks of each data-parallel replica,
    without TP, PP, ZeRO-3, PowerSGD or experts."""
    _require(isinstance(cfg.cp, int) and cfg.cp >= 1, f"cp={cfg.cp!r}: must be an integer >= 1")
    _require(
        cfg.tp == 1 and cfg.pp == 1 and cfg.zero == 0 and not cfg.powersgd_rank
        and not cfg.experts,
        f"cp={cfg.cp}: the context-parallel run has context and data parallelism only; use "
        "tp 1, pp 1, zero 0, no PowerSGD and no experts",
    )
    seq = cfg.model["seq_len"]
    _require(
        seq % (2 * cfg.cp) == 0,
        f"model.seq_len={seq}: not divisible by 2·cp={2 * cfg.cp} (two chunks per CP rank); "
        "use a multiple",
    )


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def make_config(
    *,
    tp: int,
    pp: int,
    dp: int,
    schedule: str = "1f1b",
    zero: int = 0,
    micro_batches: int = 4,
    micro_batch_size: int = 2,
    model: dict[str, Any] | str = "tiny-gpt",
    steps: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    out_dir: str | os.PathLike[str] = "measured",
    threads: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sequence_parallel: bool = False,
    seed: int = 1234,
    powersgd_rank: int = 0,
    experts: int = 0,
    ep: int = 1,
    cp: int = 1,
    slow_rank: int = -1,
    slowdown: float = 1.0,
    min_seconds: float = 0.0,
) -> MeasureConfig:
    """A validated :class:`MeasureConfig`; raises ``ValueError`` naming the bad field."""
    _require(schedule in SCHEDULES, f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    cfg = MeasureConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=schedule,
        zero=zero,
        micro_batches=micro_batches,
        micro_batch_size=micro_batch_size,
        model=resolve_model(model),
        steps=steps,
        warmup=warmup,
        device=device,
        threads=threads,
        out_dir=str(Path(out_dir).resolve()),
        timeout_s=float(timeout_s),
        sequence_parallel=sequence_parallel,
        seed=seed,
        virtual_stages=VIRTUAL_STAGES[schedule] if pp > 1 else 1,
        powersgd_rank=powersgd_rank,
        experts=experts,
        ep=ep,
        cp=cp,
        slow_rank=slow_rank,
        slowdown=float(slowdown),
        min_seconds=float(min_seconds),
    )
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- outputs
def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")

