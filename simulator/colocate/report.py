"""What ``clustersim colocate`` writes and prints: each job's step time alone and
together and its slowdown (``jobs.csv``), each shared link's busy and contended seconds
(``links.csv``), both as Markdown (``colocate.md``) and the run's numbers
(``colocate.json``), each file atomically.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.colocate.run import Colocation, uplinks
from simulator.outputs.trace_export import atomic_output
from simulator.published.report import markdown_table


def node_ranges(nodes: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5`` (in the job's order)."""
    parts: list[str] = []
    start = prev = None
    for n in [*nodes, None]:
        if start is not None and n is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return ",".join(parts)


def jobs_table(c: Colocation) -> pd.DataFrame:
    rows = []
    for i, job in enumerate(c.jobs):
        alone = c.alone[i].steps[0].times
        together = c.together.steps[i].times
        mean_alone, mean_together = statistics.fmean(alone), statistics.fmean(together)
        rows.append({
            "job": job.name, "scenario": str(c.spec.jobs[i].scenario),
            "nodes": node_ranges(job.nodes),
            "leaves": node_ranges(sorted({c.shape.leaf(n) for n in job.nodes})),
            "gpus": job.scenario.parallel.world, "steps": len(together),
            "start_s": job.start_s, "step_alone_s": mean_alone,
            "step_together_s": mean_together, "slowdown": mean_together / mean_alone,
            "worst_slowdown": max(together) / mean_alone})
    return pd.DataFrame(rows)


def links_table(c: Colocation) -> pd.DataFrame:
    names = [j.name for j in c.jobs]
    rows = []
    for link in uplinks(c):
        _, leaf, rail = link
        users = sorted(c.contention.users.get(link, ()))
        rows.append({
            "link": f"leaf {leaf} rail {rail} uplink", "leaf": leaf, "rail": rail,
            "jobs": " ".join(names[j] for j in users),
            "busy_together_s": c.together.busy.get(link, 0.0),
            "contended_s": c.contention.contended.get(link, 0.0),
            "busy_alone_s": sum(run.busy.get(link, 0.0) for run in c.alone)})
    columns = ["link", "leaf", "rail", "jobs", "busy_together_s", "contended_s",
               "busy_alone_s"]
    return pd.DataFrame(rows, columns=columns).sort_values(
        ["contended_s", "leaf", "rail"], ascending=[False, True, True], kind="stable")


def meta(c: Colocation) -> dict[str, Any]:
    s = c.shape
    return {"cluster": c.spec.name, "system": c.spec.system, "nodes": s.nodes,
            "gpus_per_node": s.gpus_per_node, "nodes_per_leaf": s.nodes_per_leaf,
            "oversubscription": s.oversubscription, "uplink_GBps": s.uplink_Bps / 1e9,
            "placement": c.spec.placement, "simulated_s": c.together.end_s}


def summary_lines(jobs: pd.DataFrame, links: pd.DataFrame, info: dict[str, Any]) -> list[str]:
    fabric = ("non-blocking" if info["oversubscription"] <= 1 else
              f"leaf uplinks {info['oversubscription']:g}:1 oversubscribed")
    lines = [f"{info['cluster']}: {len(jobs)} job(s) on {info['nodes']} {info['system']} "
             f"node(s), {info['nodes_per_leaf']} per leaf, {fabric}"]
    for r in jobs.itertuples(index=False):
        lines.append(f"  {r.job}: nodes {r.nodes} (leaves {r.leaves}), step "
                     f"{r.step_alone_s * 1e3:.4g} ms alone, {r.step_together_s * 1e3:.4g} ms "
                     f"together: slowdown {r.slowdown:.4f}x over {r.steps} step(s)")
    hot = links[links["contended_s"] > 0]
    if len(hot):
        lines.append(f"{len(hot)} shared link(s) carried several jobs at once; most: "
                     + ", ".join(f"{r.link} {r.contended_s * 1e3:.3g} ms ({r.jobs})"
                                 for r in hot.head(3).itertuples(index=False)))
    else:
        lines.append("no link carried two jobs' flows at once")
    return lines


def _markdown(jobs: pd.DataFrame, links: pd.DataFrame, info: dict[str, Any]) -> str:
    fmt = jobs.assign(**{k: jobs[k].map("{:.6g}".format) for k in
                         ("start_s", "step_alone_s", "step_together_s")},
                      slowdown=jobs["slowdown"].map("{:.4f}".format),
                      worst_slowdown=jobs["worst_slowdown"].map("{:.4f}".format))
    lk = links.assign(**{k: links[k].map("{:.6g}".format) for k in
                         ("busy_together_s", "contended_s", "busy_alone_s")})
    return "\n".join([f"# Colocation: {info['cluster']}", "",
                      *summary_lines(jobs, links, info), "", "## Jobs", "",
                      markdown_table(fmt), "", "## Shared links", "",
                      markdown_table(lk) if len(lk) else "none (a non-blocking fabric, or "
                      "no job's flows left its leaf)", ""])


def write_report(out: Path, c: Colocation) -> tuple[list[Path], list[str]]:
    """Write the tables; the paths written and the summary lines."""
    from simulator.outputs.search_files import write_table

    jobs, links, info = jobs_table(c), links_table(c), meta(c)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(jobs, out / "jobs.csv"), write_table(links, out / "links.csv")]
    with atomic_output(out / "colocate.md") as tmp:
        tmp.write_text(_markdown(jobs, links, info), encoding="utf-8")
    written.append(out / "colocate.md")
    steps = {j.name: {"alone_s": c.alone[i].steps[0].times,
                      "together_s": c.together.steps[i].times, "nodes": j.nodes}
             for i, j in enumerate(c.jobs)}
    with atomic_output(out / "colocate.json") as tmp:
        tmp.write_text(json.dumps({**info, "jobs": jobs.to_dict("records"), "steps": steps},
                                  indent=2, allow_nan=False) + "\n", encoding="utf-8")
    written.append(out / "colocate.json")
    return written, summary_lines(jobs, links, info)
