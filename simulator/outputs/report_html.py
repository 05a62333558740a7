"""``report.html``: one self-contained page per run, next to its other outputs.

The page is what a person opens first: the summary the CLI printed, the step's
breakdown and the critical path as tables (every category, seconds and share, in the
accounting's order), the memory per stage with its verdict, the timeline, the
what-if (when the run had ``--what-if``) and how to open ``trace.json`` in Perfetto.
Every image is inlined as a base64 ``data:`` URI and the style sheet is in the page,
so the file can be mailed or attached on its own; it has no script. Text from the
scenario (its name, a description) is HTML-escaped. The page reads only
``results.json``'s contract and the PNGs beside it, so ``clustersim plot DIR``
writes it again after re-drawing the figures.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulator.analysis.accounting.vocabulary import categories, label
from simulator.outputs.trace_export import atomic_output

REPORT = "report.html"
#: Section id -> heading, in page order (a test checks each is present).
SECTIONS: dict[str, str] = {
    "summary": "Summary", "breakdown": "Where the step goes", "critical-path": "Critical path",
    "memory": "Memory", "timeline": "Timeline", "what-if": "What bounds the step",
    "trace": "The trace in Perfetto"}
#: Section id -> the figure it shows (when the run drew it).
FIGURES = {"breakdown": "breakdown.png", "memory": "memory.png", "timeline": "timeline.png"}
_STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222}h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;
padding-bottom:.2em;margin-top:2em}pre{background:#f6f6f6;padding:1em;overflow-x:auto}
table{border-collapse:collapse}td,th{padding:.25em .8em;border-bottom:1px solid #eee;
text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%;
border:1px solid #eee}.bad{color:#c00000;font-weight:bold}.note{color:#666}"""


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _shares(seconds: Mapping[str, float], step: float) -> str:
    order = {c: i for i, c in enumerate(categories())}
    rows = [(label(c), f"{v:.4g} s", f"{v / step:.1%}" if step > 0 else "")
            for c, v in sorted(seconds.items(), key=lambda kv: order.get(kv[0], len(order)))
            if v > 0]
    return _table(("category", "seconds", "share of the step"), rows)


def _memory(results: Mapping[str, Any]) -> str:
    rows = [(str(m["stage"]), *(f"{m.get(k, 0.0) / 1e9:.2f}" for k in
                                ("weights", "gradients", "optimizer", "activations", "logits",
                                 "comm_buffers", "total", "capacity")),
             "yes" if m["total"] <= m["capacity"] else "NO") for m in results["memory"]]
    fits = results["fits_in_memory"]
    peak = f'peak {results["memory_peak_bytes"] / 1e9:.1f} GB: '
    verdict = f"<p>{peak}fits</p>" if fits else f'<p class="bad">{peak}DOES NOT FIT</p>'

    return verdict + _table(("stage", "weights", "grads", "optimizer", "activations",
                             "logits", "buffers", "total", "capacity", "fits"), rows)


def _what_if(results: Mapping[str, Any]) -> str:
    if "what_if" not in results:
        return ('<p class="note">Not computed for this run: <code>clustersim run SCENARIO '
                '--what-if</code> re-simulates with each cost class 10% faster.</p>')
    from simulator.analysis.whatif import what_if_lines

    return f"<pre>{html.escape(chr(10).join(what_if_lines(results['what_if'])))}</pre>"


def _trace(out_dir: Path) -> str:
    name = next((n for n in ("trace.json", "trace.json.gz") if (out_dir / n).is_file()), None)
    if name is None:
        return '<p class="note">No trace: an analytic run has no timeline.</p>'
    return ('<p>Open <a href="https://ui.perfetto.dev">ui.perfetto.dev</a>, choose '
            f'<em>Open trace file</em> and pick <a href="{name}"><code>{name}</code>'
            '</a> from this directory (or drag it onto the page); one process per rank, one '
            'thread per stream. <code>chrome://tracing</code> loads it too.</p>')


def report_html(out_dir: Path, results: Mapping[str, Any], summary: list[str]) -> str:
    """The page for the run in ``out_dir`` (its PNGs read from there)."""
    step = float(results["step_time_s"])
    body = {
        "summary": f"<pre>{html.escape(chr(10).join(summary))}</pre>",
        "breakdown": _shares(results.get("step_breakdown_s") or {}, step),
        "critical-path": _shares(results.get("critical_path_s") or {}, step)
        if results.get("critical_path_s") else '<p class="note">An analytic run has no '
        "critical path.</p>",
        "memory": _memory(results),
        "timeline": "" if (out_dir / "timeline.png").is_file() else '<p class="note">No '
        "timeline: an analytic run, or a run with --no-plots.</p>",
        "what-if": _what_if(results),
        "trace": _trace(out_dir),
    }
    for section, name in FIGURES.items():
        if (out_dir / name).is_file():
            body[section] += _img(out_dir / name, f"{SECTIONS[section]} ({name})")
        elif section != "timeline":
            body[section] += f'<p class="note">{name} not drawn (--no-plots).</p>'
    name = html.escape(str(results.get("scenario", {}).get("name", "run")))
    parts = [f'<section id="{sid}"><h2>{html.escape(SECTIONS[sid])}</h2>{body[sid]}</section>'
             for sid in SECTIONS]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{name}: '
            f"clustersim run</title><style>{_STYLE}</style></head><body><h1>{name}</h1>"
            + "".join(parts) + "</body></html>\n")


def write_report(out_dir: Path, results: Mapping[str, Any], summary: list[str]) -> Path:
    """Write ``out_dir/report.html`` atomically."""
    path = out_dir / REPORT
    with atomic_output(path) as tmp:
        tmp.write_text(report_html(out_dir, results, summary), encoding="utf-8")
    return path
