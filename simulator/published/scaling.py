"""Weak scaling as a table's rows measured it and as the simulation gives it.

Rows that differ only in their GPU count (the same GPU, model, sequence, tokens a GPU
runs per micro-batch, sequences a data-parallel replica runs a step, sharding,
checkpointing, dtype, attention kernel and unit) form a series;
for each series of two counts or more, :func:`weak_scaling` sets the per-GPU rate at
every count over the rate at the series' smallest, measured and simulated. A
simulation that loses less per GPU going out than the runs did reads as a measured
ratio below the simulated one: the scale-out cost it leaves out (``scaling.csv``, a
section of ``runs.md`` and one printed line of ``clustersim validate-runs``).

The per-GPU rate is the row's figure where it is one already (tokens/s/GPU, MFU), the
figure over the GPU count for a total (tokens/s, seq/s) and the inverse of a step time
(a weak-scaling series keeps each GPU's batch, so its step should not grow); peak
memory is not a rate and takes no part.
"""

from __future__ import annotations

import math

import pandas as pd

#: what makes two rows one series but their GPU count
SERIES = ("gpu", "model", "seq_len", "micro_batch_tokens", "replica_sequences", "sharding",
          "recompute", "dtype", "attention", "unit")
COLUMNS = (*SERIES, "gpus_base", "gpus", "measured_ratio", "simulated_ratio", "gap")


def per_gpu(value: float, unit: str, gpus: int) -> float:
    """A row's figure as a per-GPU rate (NaN for a unit that is not a rate)."""
    u = unit.strip().lower()
    if u in ("tokens/s/gpu", "mfu"):
        return value
    if u in ("tokens/s", "seq/s"):
        return value / gpus
    if u in ("s/step", "step_time_s"):
        return 1.0 / value if value > 0 else math.nan
    return math.nan


def weak_scaling(table: pd.DataFrame) -> pd.DataFrame:
    """One line per compared row of a series of two GPU counts or more but its smallest:
    its per-GPU rate over the smallest count's, measured and simulated, and the gap
    (simulated ratio over measured − 1: positive, the simulation loses less going out)."""
    done = table[table["error"].notna()].copy()
    if done.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    done["rate_measured"] = [per_gpu(m, u, g) for m, u, g in
                             zip(done["measured"], done["unit"], done["gpus"], strict=True)]
    done["rate_simulated"] = [per_gpu(m, u, g) for m, u, g in
                              zip(done["simulated"], done["unit"], done["gpus"], strict=True)]
    done = done[done["rate_measured"].notna() & done["rate_simulated"].notna()]
    out = []
    for key, group in done.groupby(list(SERIES), sort=True, dropna=False):
        by_count = group.groupby("gpus")[["rate_measured", "rate_simulated"]].mean()
        if len(by_count) < 2:
            continue
        base = by_count.iloc[0]
        for gpus, rates in by_count.iloc[1:].iterrows():
            measured = rates["rate_measured"] / base["rate_measured"]
            simulated = rates["rate_simulated"] / base["rate_simulated"]
            out.append((*key, int(by_count.index[0]), int(gpus), measured, simulated,
                        simulated / measured - 1.0))
    return pd.DataFrame(out, columns=list(COLUMNS))


def scaling_line(scaling: pd.DataFrame) -> str | None:
    """The printed line: at each series' largest count, the median measured and simulated
    ratio and the median gap (None without a series)."""
    if scaling.empty:
        return None
    last = scaling.loc[scaling.groupby(list(SERIES), dropna=False)["gpus"].idxmax()]
    return (f"weak scaling ({len(last)} series of 2+ GPU counts), per-GPU rate at the largest "
            f"count over the smallest (median): measured x{last['measured_ratio'].median():.3f}"
            f", simulated x{last['simulated_ratio'].median():.3f}, gap "
            f"{last['gap'].median():+.1%}")
