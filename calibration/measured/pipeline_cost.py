"""torch.distributed.pipelining's host time per action (``gpu.pipeline_action_us``).

A stage of ``torch.distributed.pipelining`` runs every F and B action through Python:
the schedule's loop (``torch/distributed/pipelining/schedules.py``,
``_step_microbatches``), the stage's receive and send ops (``get_fwd_recv_ops``,
``get_fwd_send_ops``, ``dist.batch_isend_irecv`` and the waits on its works), the
micro-batch's forward and its ``stage_backward`` autograd call
(``torch/distributed/pipelining/_backward.py``). None of it is a kernel, and on a CPU
"device" it runs on the core that runs the kernels.

The measurement: the measured runs' own two-stage GPipe launch (gloo, one thread per
rank) at a degenerate size (:data:`PIPE_GPT`, every kernel a few microseconds, every
send a few hundred bytes), at :data:`MICRO_BATCHES` 4 and 16 micro-batches; each
micro-batch more adds one F and one B action on each stage. The slope of the measured
step over the micro-batches, less the slope the profile already gives the same
scenario (kernels, host cost per kernel, sends), is the runtime's host time per two
actions. It is the runs' framework at a size where nothing but the framework costs
anything, not a fit to the validated configurations (:mod:`calibration.measured.
host_cost` measures the plain step and DTensor the same way).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

#: the degenerate GPT: kernels of microseconds, sends of a few hundred bytes
PIPE_GPT = {"layers": 4, "hidden": 16, "heads": 2, "ffn_hidden": 16, "vocab": 16, "seq_len": 8}
MICRO_BATCHES = (4, 16)
STEPS, WARMUP = 30, 5


def action_us(measured_s: tuple[float, float], simulated_s: tuple[float, float],
              micro_batches: tuple[int, int] = MICRO_BATCHES) -> float:
    """Host microseconds per action: (measured slope − simulated slope) over the
    micro-batches, halved (one F and one B each), at least 0."""
    extra = micro_batches[1] - micro_batches[0]
    slope = (measured_s[1] - measured_s[0]) / extra - (simulated_s[1] - simulated_s[0]) / extra
    return round(max(slope / 2, 0.0) * 1e6, 3)


def measure_action_us(profile: str, threads: int,
                      timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the two degenerate launches, simulate them with ``profile`` (which must not
    carry the term yet) and return the figure with what it came from."""
    from calibration.measured.compare import compare
    from calibration.measured.measure import run_measure

    measured, simulated = [], []
    with tempfile.TemporaryDirectory(prefix="clustersim-pipe-") as tmp:
        for m in MICRO_BATCHES:
            run_dir = Path(tmp) / f"m{m}"
            run_measure(1, 2, 1, schedule="gpipe", micro_batches=m, micro_batch_size=1,
                        model=dict(PIPE_GPT), steps=STEPS, warmup=WARMUP, device="cpu",
                        out_dir=str(run_dir), threads=threads, timeout_s=timeout_s)
            comparison = compare(run_dir, profile)
            measured.append(comparison["measured"]["step_time_s"])
            simulated.append(comparison["simulated"]["step_time_s"])
    ms, ss = (measured[0], measured[1]), (simulated[0], simulated[1])
    return {"pipeline_action_us": action_us(ms, ss), "micro_batches": list(MICRO_BATCHES),
            "measured_step_s": list(ms), "simulated_step_s": list(ss), "model": PIPE_GPT}


def add_to_profile(path: str, threads: int) -> dict[str, Any]:
    """Measure and write ``gpu.pipeline_action_us`` into the CPU profile at ``path``
    (atomically, validated), with its provenance."""
    import yaml

    from calibration.microbench.profile_build import write_profile

    profile = yaml.safe_load(Path(path).read_text())
    profile["gpu"].pop("pipeline_action_us", None)  # the slope the profile gives without it
    write_profile(profile, Path(path))
    got = measure_action_us(path, threads)
    profile["gpu"]["pipeline_action_us"] = got["pipeline_action_us"]
    profile.setdefault("provenance", {})["pipeline_action"] = got
    write_profile(profile, Path(path))
    return got
