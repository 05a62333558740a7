"""The validation's configurations: what runs on a CPU (world size 2) and what joins on
four or more GPUs, the measured models and their steps, and the flags that pick among
them (``--only``, ``--model``).

Each configuration is one measured run's layout (:class:`Config`: the degrees, the
schedule, ZeRO, and the variants the measured workers offer: PowerSGD, the MoE GPT with
EP, CP, a straggler on purpose, sequence parallelism), simulated with the same scenario
(:mod:`calibration.measured.measure_scenario`).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import Problem, UserError


@dataclass(frozen=True)
class Config:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    zero: int = 0
    powersgd_rank: int = 0  # PyTorch's PowerSGD DDP hook (calibration/measured/compression_hook)
    experts: int = 0  # > 0: the MoE GPT with EP (calibration/measured/moe_worker)
    ep: int = 1
    cp: int = 1  # > 1: the sequence split, K and V all-gathered (calibration/measured/cp_worker)
    slow_rank: int = -1  # a straggler on purpose (calibration/measured/slow_rank.py) ...
    slowdown: float = 1.0  # ... whose compute takes this many times as long
    sequence_parallel: bool = False  # TP with DTensor SequenceParallel (parallel_worker.tp_plan)


CPU_CONFIGS = (
    Config("dp2-ddp", dp=2),
    Config("dp2-powersgd", dp=2, powersgd_rank=4),
    Config("pp2-gpipe", pp=2, schedule="gpipe"),
    Config("pp2-1f1b", pp=2, schedule="1f1b"),
    Config("tp2", tp=2),
    Config("tp2-sp", tp=2, sequence_parallel=True),
    Config("fsdp2", dp=2, zero=3),
    Config("ep2-moe", dp=2, experts=4, ep=2),
    Config("cp2-allgather", cp=2),
    Config("dp2-slow1x2", dp=2, slow_rank=1, slowdown=2.0),
    Config("pp2-1f1b-slow1x2", pp=2, schedule="1f1b", slow_rank=1, slowdown=2.0),
)
MULTI_GPU_CONFIGS = (
    Config("tp2-pp2", tp=2, pp=2),
    Config("dp2-pp2", dp=2, pp=2),
)
#: timed and warm-up steps per run by model, where --steps/--warmup leave them: a
#: tiny-gpt step is ~50-300 ms, so more of them cost little and steady the median
MODEL_STEPS = {"small-gpt": (8, 2), "tiny-gpt": (30, 5)}
#: ... and on CPU at least this many seconds of them (``measure --min-seconds``): on the
#: project's 2-core VM a run's level moves on a scale of seconds (tiny-gpt TP 2, six
#: 30-step runs back to back, 13 s each: medians 373-496 ms, none of it in a reference
#: GEMM loop timed between them), so a 2-3 s tiny-gpt run was one draw of that level
MIN_SECONDS = {"cpu": 20.0, "cuda": 0.0}
MODELS = tuple(MODEL_STEPS)


def configs_for(device: str, devices: int) -> tuple[Config, ...]:
    extra = MULTI_GPU_CONFIGS if device == "cuda" and devices >= 4 else ()
    return CPU_CONFIGS + extra


def select(configs: tuple[Config, ...], only: str | None) -> tuple[Config, ...]:
    """The configurations named in ``only`` (comma-separated), in table order; all without."""
    if not only:
        return configs
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [c.name for c in configs]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError([Problem("--only", only, f"unknown configuration(s) {unknown}; "
                                 f"choose from {', '.join(known)}")])
    return tuple(c for c in configs if c.name in names)


def models(spec: str) -> tuple[str, ...]:
    """The models named by ``--model`` (comma-separated), or a UserError naming them."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise UserError([Problem("--model", spec, f"unknown model(s) {unknown}; use one "
                                 f"or more of {', '.join(MODELS)}, comma-separated")])
    return names
