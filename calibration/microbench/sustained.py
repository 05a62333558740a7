"""Burst against sustained: does a kernel run slower under a training-like load than in
the short timings calibration and the published kernel benchmarks take?

Two kernels, one device, one after the other: a square GEMM (random-normal operands;
bf16 on a GPU, fp32 on a CPU) and causal ``scaled_dot_product_attention`` forward and
backward (b 2, 16 heads, s 4096, d 128 on a GPU; b 1, 2 heads, s 128, d 32 on a CPU).
For each, a *phase*:

1. an idle pause (1 s on a GPU: the sleep FlashAttention-3's ``hopper/benchmark_attn.py``,
   commit 20b84d6, takes between kernels "to avoid residual power throttling", and the
   cool-down CUTLASS's GEMM guidelines use between tests);
2. the *burst*: about 5 ms of calls to warm up, then about 10 ms of back-to-back calls
   timed between two CUDA events (``perf_counter`` on a CPU): the span FA3's
   ``do_bench(warmup=5, rep=10)`` times;
3. the *sustained* run: the same calls back to back for ``--seconds`` (60 on a GPU),
   timed in windows of 1 s (of ``seconds / 8`` where that is shorter, so there are
   always eight), the host kept at most one window ahead so that the device never idles.

Each window's TFLOP/s is its calls × FLOPs a call over its seconds. The phase's
**ratio** is the median TFLOP/s of the last half of the windows (the last ⌈n/2⌉ of n)
over the burst's: below 1, the kernel runs slower once the load has lasted (clocks
settled under the power or thermal limit) than a burst after idle says. FLOPs: 2N³ a
GEMM; attention as a causal kernel executes it, 4·b·a·s²·d/2 forward and twice that
backward (the calibration's backward convention; FA3 counts 2.5×), so 6·b·a·s²·d a call;
the ratio does not depend on the convention.

On a GPU, nvidia-smi samples the SM clock, power, temperature and clock-event reasons
every 200 ms through each phase (:mod:`calibration.microbench.sustained_smi`; without it,
null): per part (idle, burst, sustained) the median MHz and watts, and the raw samples.

Why: CUTLASS's "GEMM Performance Measurement Methodology Guidelines" (NVIDIA/cutlass
``media/docs/cpp/gemm_performance_measurement_methodology_guidelines.md``) observed GPC
clocks oscillating for about the first 3 s of back-to-back GEMMs before settling, and
call fixed-power tests (the factory's DVFS) the ones that mimic real-world use; Horace He
(thonking.ai, "Strangely, Matrix Multiplications on GPUs Run Faster When Given
Predictable Data", 2024) measured an A100's cuBLAS 8192³ at about 258 TFLOP/s on
random-normal operands against 295 on zeros: power, not arithmetic, sets the clock. No
published same-GPU burst-against-sustained GEMM figure was found; the project's GPU
curves come from ``clustersim calibrate`` (batches of at least 2 ms, about 0.05 s a shape
at ``--quick``: :mod:`calibration.microbench.bench_timing`). The operands here are
``randn`` (He's; calibration fills uniform(−1, 1), CUTLASS's choice): burst and
sustained see the same data, so the ratio compares like with like.

The JSON is written atomically after each phase (a cut run keeps the GEMM's);
``benchmarks/gpu_validation.sh`` runs it. No preset uses it yet. torch is imported lazily.

    python -m calibration.microbench.sustained --out sustained.json             # GPU, 60 s a kernel
    python -m calibration.microbench.sustained --out s.json --device cpu --seconds 2 --size 64
"""

from __future__ import annotations

import argparse
import itertools
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from calibration.microbench.sustained_smi import SmiSampler, smi_command, summarise
from simulator.errors import Interrupted, Problem, UserError

SCHEMA = "clustersim.sustained/1"
WARMUP_S = 0.005  # do_bench's warmup=5 (ms)
BURST_S = 0.010  # do_bench's rep=10 (ms)
WINDOW_S = 1.0
MIN_WINDOWS = 8
#: per device: seconds a phase's sustained run lasts, the GEMM's N, the idle pause (s)
DEFAULTS = {"cuda": (60.0, 8192, 1.0), "cpu": (4.0, 128, 0.2)}
ATTENTION = {"cuda": (2, 16, 4096, 128), "cpu": (1, 2, 128, 32)}  # batch, heads, seq, d
DTYPE = {"cuda": "bf16", "cpu": "fp32"}
MAX_SECONDS = 3600.0
MAX_SIZE = 32768


@dataclass(frozen=True)
class Kernel:
    """One kernel to load the device with: ``call()`` runs it once."""

    name: str  # gemm | attention
    label: str
    flops: float  # a call's
    shape: dict[str, Any]
    call: Callable[[], object]


class Clock:
    """Marks on the device's timeline: CUDA events, or ``perf_counter`` on a CPU (whose
    calls return when done)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def mark(self) -> Any:
        if self.kind != "cuda":
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark: Any) -> None:
        if self.kind == "cuda":
            mark.synchronize()

    def seconds(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3 if self.kind == "cuda" else float(b - a)


def gemm_kernel(device: str, n: int, dtype: Any) -> Kernel:
    """Y = A·B, N×N, two operand sets alternated (CUTLASS's two buffers at least)."""
    import torch

    dev = "cuda" if device == "cuda" else "cpu"
    sets = [(torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev,
                                                                       dtype=dtype))
            for _ in range(2)]
    out = torch.empty(n, n, device=dev, dtype=dtype)
    turn = [0]

    def call() -> object:
        a, b = sets[turn[0] & 1]
        turn[0] += 1
        return torch.matmul(a, b, out=out)
    return Kernel("gemm", f"{n}³", 2.0 * n**3, {"m": n, "n": n, "k": n}, call)


def attention_kernel(device: str, shape: tuple[int, int, int, int], dtype: Any) -> Kernel:
    """Causal SDPA forward and its gradient in q, k and v (``torch.autograd.grad``: no
    accumulation kernel), two input sets alternated."""
    import torch
    import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention

    b, h, s, d = shape
    dev = "cuda" if device == "cuda" else "cpu"
    sets = [[torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=i < 3)
             for i in range(4)] for _ in range(2)]
    turn = [0]

    def call() -> object:
        q, k, v, dout = sets[turn[0] & 1]
        turn[0] += 1
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(o, (q, k, v), dout)
    return Kernel("attention", f"b{b}h{h}s{s}d{d} causal fwd+bwd", 6.0 * b * h * s * s * d,
                  {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": True}, call)


def estimate(clock: Clock, call: Callable[[], object]) -> float:
    """Seconds a call, roughly: two calls to warm up (cuBLAS heuristics, the allocator),
    then batches doubling from three calls until one lasts 2 ms."""
    for _ in range(2):
        call()
    calls = 3
    while True:
        a = clock.mark()
        for _ in range(calls):
            call()
        b = clock.mark()
        clock.wait(b)
        took = clock.seconds(a, b)
        if took >= 2e-3 or calls >= 1 << 16:
            return max(took / calls, 1e-9)
        calls *= 2


def burst(clock: Clock, call: Callable[[], object], per_call_s: float) -> dict[str, Any]:
    """About :data:`WARMUP_S` of calls, then :data:`BURST_S` of them timed; the warm-up's
    calls are queued ahead, so the timed ones run back to back."""
    for _ in range(max(1, math.ceil(WARMUP_S / per_call_s))):
        call()
    calls = max(1, math.ceil(BURST_S / per_call_s))
    a = clock.mark()
    for _ in range(calls):
        call()
    b = clock.mark()
    clock.wait(b)
    return {"calls": calls, "seconds": clock.seconds(a, b)}


def sustained(clock: Clock, call: Callable[[], object], calls: int,
              seconds: float) -> list[dict[str, Any]]:
    """Windows of ``calls`` calls back to back until ``seconds`` have passed on the host;
    each window's seconds and its end since the first (``t_s``)."""
    marks = [clock.mark()]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(calls):
            call()
        marks.append(clock.mark())
        if len(marks) > 2:  # the window before this one done: at most one queued ahead
            clock.wait(marks[-2])
    clock.wait(marks[-1])
    return [{"t_s": clock.seconds(marks[0], b), "seconds": clock.seconds(a, b), "calls": calls}
            for a, b in itertools.pairwise(marks)]


def sustained_ratio(windows: Sequence[dict[str, Any]], burst_tflops: float) -> float:
    """Median TFLOP/s of the last ⌈n/2⌉ of n windows over the burst's."""
    last = [w["tflops"] for w in windows[len(windows) // 2:]]
    return statistics.median(last) / burst_tflops


def run_phase(kernel: Kernel, clock: Clock, seconds: float, idle_s: float,
              smi: list[str] | None) -> dict[str, Any]:
    """Idle, burst, sustained for one kernel; nvidia-smi sampled throughout when given."""
    per_call = estimate(clock, kernel.call)
    window_s = min(WINDOW_S, seconds / MIN_WINDOWS)
    calls = max(1, round(window_s / per_call))
    sampler = SmiSampler(smi) if smi else None
    bounds: dict[str, float] = {}
    try:
        if sampler:
            sampler.start()
        bounds["idle"] = time.time()
        time.sleep(idle_s)
        bounds["burst"] = time.time()
        b = burst(clock, kernel.call, per_call)
        bounds["sustained"] = time.time()
        windows = sustained(clock, kernel.call, calls, seconds)
        bounds["end"] = time.time()
    finally:
        samples = sampler.stop() if sampler else None
    b["tflops"] = b["calls"] * kernel.flops / b["seconds"] / 1e12
    for w in windows:
        w["tflops"] = w["calls"] * kernel.flops / w["seconds"] / 1e12
    last = windows[len(windows) // 2:]
    return {
        "kernel": kernel.label, "shape": kernel.shape, "flops_per_call": kernel.flops,
        "burst": b, "window_s": window_s, "windows": windows,
        "sustained_tflops": statistics.median(w["tflops"] for w in last),
        "sustained_windows": len(last), "ratio": sustained_ratio(windows, b["tflops"]),
        "clocks": summarise(samples, bounds) if samples is not None else None,
        "samples": samples,
    }


def _device_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
        facts["sdpa_enabled"] = {name: bool(getattr(torch.backends.cuda, f"{name}_sdp_enabled",
                                                    lambda: False)())
                                 for name in ("flash", "mem_efficient", "cudnn", "math")}
    else:
        from calibration.host import cpu_name

        facts["device_name"] = cpu_name()
    return facts


def measure(device: str, seconds: float, size: int, idle_s: float,
            on_phase: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Both phases on ``device`` (GEMM, then attention); ``on_phase(result)`` after each,
    the result so far (the attention phase null until it is done)."""
    import torch

    from calibration.microbench.bench_timing import Device, torch_dtype

    Device(device).setup()  # one thread on a CPU, as calibration's; no TF32 on a GPU
    dtype = torch_dtype(DTYPE[device])
    smi = smi_command(torch.cuda.get_device_properties(0)) if device == "cuda" else None
    result: dict[str, Any] = {
        "schema": SCHEMA, **_device_facts(device), "dtype": DTYPE[device],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {"seconds": seconds, "size": size, "idle_s": idle_s,
                     "warmup_s": WARMUP_S, "burst_s": BURST_S},
        "nvidia_smi": smi.describe() if smi else None,
        "phases": {"gemm": None, "attention": None},
    }
    clock = Clock(device)
    command = smi.command if smi and smi.command else None
    for name, make in (("gemm", lambda: gemm_kernel(device, size, dtype)),
                       ("attention", lambda: attention_kernel(device, ATTENTION[device], dtype))):
        kernel = make()
        result["phases"][name] = run_phase(kernel, clock, seconds, idle_s, command)
        del kernel
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_phase:
            on_phase(result)
    return result


def _phase_line(name: str, p: dict[str, Any] | None) -> str:
    if p is None:
        return f"{name}: not measured"
    clocks = (p.get("clocks") or {}).get("sustained") or {}
    clock = (f"; SM clock {clocks['sm_mhz']:.0f} MHz, {clocks['power_w']:.0f} W (medians)"
             if clocks.get("sm_mhz") is not None and clocks.get("power_w") is not None else "")
    return (f"{name} {p['kernel']}: sustained/burst {p['ratio']:.3f} (burst "
            f"{p['burst']['tflops']:.4g}, sustained {p['sustained_tflops']:.4g} TFLOP/s, median "
            f"of the last {p['sustained_windows']} of {len(p['windows'])} windows{clock})")


def describe(result: dict[str, Any]) -> str:
    """One line for a summary: each kernel's ratio, TFLOP/s and sustained SM clock."""
    s = result["settings"]
    phases = "; ".join(_phase_line(n, result["phases"].get(n)) for n in ("gemm", "attention"))
    return (f"Sustained load on {result['device_name']} ({result['dtype']}, "
            f"{s['seconds']:g} s a kernel after {s['idle_s']:g} s idle): {phases}.")


class _Parser(argparse.ArgumentParser):
    """A bad option is one ``error:`` line and exit 2 (calibration does not import the CLI)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _parser() -> _Parser:
    p = _Parser(prog="python -m calibration.microbench.sustained",
                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", required=True, help="the JSON to write (atomically)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seconds", type=float, default=None,
                   help="each kernel's sustained run (default 60 on cuda, 4 on cpu)")
    p.add_argument("--size", type=int, default=None,
                   help="the square GEMM's N (default 8192 on cuda, 128 on cpu)")
    p.add_argument("--idle", type=float, default=None,
                   help="idle pause before each burst, s (default 1 on cuda, 0.2 on cpu)")
    return p


def resolve(args: Any) -> tuple[float, int, float]:
    """--seconds, --size and --idle with the device's defaults, each checked."""
    seconds, size, idle = DEFAULTS[args.device]
    seconds = seconds if args.seconds is None else args.seconds
    size = size if args.size is None else args.size
    idle = idle if args.idle is None else args.idle
    problems = []
    if not 0 < seconds <= MAX_SECONDS:
        problems.append(Problem("--seconds", seconds, f"give seconds in (0, {MAX_SECONDS:g}]"))
    if not 8 <= size <= MAX_SIZE:
        problems.append(Problem("--size", size, f"give N from 8 to {MAX_SIZE}"))
    if not 0 <= idle <= 600:
        problems.append(Problem("--idle", idle, "give seconds from 0 to 600"))
    if problems:
        raise UserError(problems[:1])  # one line
    return seconds, size, idle


def _terminated(signum: int, frame: object) -> None:
    raise Interrupted("SIGTERM")


def main(argv: Sequence[str] | None = None) -> int:
    from simulator.outputs.writing import check_file_destination

    args = _parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        seconds, size, idle = resolve(args)
        out = check_file_destination(args.out, "--out")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UserError([Problem("--device", "cuda", "no CUDA device here; "
                                         "use --device cpu")])
        result = measure(args.device, seconds, size, idle, lambda r: write(r, out))
    except UserError as exc:
        print(f"error: {exc.lines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        name = getattr(exc, "signal_name", "SIGINT")
        print(f"interrupted ({name}): a phase finished before it is in {args.out}",
              file=sys.stderr)
        return 143 if name == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"device: {result['device_name']}, torch {result['torch']}")
    for name in ("gemm", "attention"):
        print("  " + _phase_line(name, result["phases"][name]))
    print(f"wrote {out}")
    return 0


def write(result: dict[str, Any], path: Any) -> None:
    """``result`` as JSON at ``path``: serialised first, then a temporary file renamed
    over it, so ``path`` is the old file or the whole new one, never a part."""
    import json

    from simulator.outputs.writing import atomic_output

    text = json.dumps(result, indent=1, allow_nan=False) + "\n"
    with atomic_output(path, "--out") as tmp:
        tmp.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
