"""PowerSGD's kernels on this machine against their simulated price: what the hook costs.

``python -m calibration.measured.powersgd_kernels --profile P.yaml [--model small-gpt]
[--rank 4]`` times, one thread, median CPU seconds (``time.process_time``, so a busy
machine inflates it little), the kernels ``powerSGD_hook`` runs per compressed
matrix of the measured GPT (P = M·Q, Q = Mᵀ·P, M = P·Qᵀ with ``torch.bmm``) and its
passes over the whole gradient (the error-feedback add, the copy of the bucket,
the new error ``copy − M``, both as the hook writes them: a fresh tensor each
step), and prints each beside the price :mod:`simulator.strategies.compression.arithmetic` gives it
with the profile. It is the diagnostic behind the PowerSGD row of the
validation table (docs/validation.md): where the simulated hook is short, which kernel.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from calibration.measured.gpt_presets import PRESETS


def _median_cpu_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[repeats // 2]


def kernel_table(profile: str, model: str, rank: int, repeats: int = 9) -> list[tuple[str, float,
                                                                                     float]]:
    """(kernel, measured s, simulated s) per step of the hook on ``model``'s gradients."""
    import torch

    from simulator.strategies.compression import arithmetic as cmp
    from simulator.system.costs import CostModel
    from simulator.system.profiles import load_system

    torch.set_num_threads(1)
    cost = CostModel(load_system(profile), "fp32")
    sizes = PRESETS[model]
    h, f, v, s = sizes["hidden"], sizes["ffn_hidden"], sizes["vocab"], sizes["seq_len"]
    shapes = [(h, h)] * 4 * sizes["layers"] + [(f, h), (h, f)] * sizes["layers"] \
        + [(v, h), (s, h)]
    rows: dict[str, list[float]] = {}
    for n, m in sorted(set(shapes)):
        count = shapes.count((n, m))
        mat, q, p = torch.randn(1, n, m), torch.randn(1, m, rank), torch.empty(1, n, rank)
        # (name, left, right, out, the GEMM's m, k, n): as the hook calls torch.bmm
        calls = (("P = M·Q", mat, q, p, (n, m, rank)),
                 ("Q = Mᵀ·P", mat.transpose(1, 2), p, torch.empty(1, m, rank), (m, n, rank)),
                 ("M = P·Qᵀ", p, q.transpose(1, 2), mat, (n, rank, m)))
        for name, left, right, out, dims in calls:
            row = rows.setdefault(name, [0.0, 0.0])
            row[0] += count * _median_cpu_s(partial(torch.bmm, left, right, out=out), repeats)
            row[1] += count * cost.op_time(cmp.fp32_gemm(name, *dims))
    elements = sum(n * m for n, m in shapes)
    x, y = torch.randn(elements), torch.randn(elements)
    passes: tuple[tuple[str, Callable[[], Any], int], ...] = (
        ("error add (in place)", lambda: x.add_(y), 12 * elements),
        ("bucket copy (fresh tensor)", x.clone, 8 * elements),
        ("new error (fresh tensor)", lambda: x - y, 12 * elements),
    )
    for name, fn, nbytes in passes:
        rows[name] = [_median_cpu_s(fn, max(3, repeats // 3)),
                      cost.op_time(cmp._pass(name, nbytes))]
    return [(name, measured, sim) for name, (measured, sim) in rows.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--profile", required=True, help="hardware profile YAML (calibrated)")
    parser.add_argument("--model", default="small-gpt", choices=sorted(PRESETS))
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args(argv)
    rows = kernel_table(args.profile, args.model, args.rank)
    print(f"{'kernel, per step':<28} {'measured ms':>12} {'simulated ms':>13}")
    for name, measured, simulated in rows:
        print(f"{name:<28} {measured * 1e3:>12.1f} {simulated * 1e3:>13.1f}")
    total = [sum(r[1] for r in rows), sum(r[2] for r in rows)]
    print(f"{'all':<28} {total[0] * 1e3:>12.1f} {total[1] * 1e3:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
