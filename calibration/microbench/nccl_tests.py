"""Reading NVIDIA nccl-tests output (``-J`` JSON or the text table) as collective samples.

Text table (``all_reduce_perf -b 8 -e 1G -f 2 -g 8``): comment lines start with
``#``; the device lines ``#  Rank  0 Group  0 Pid 123 on host device 0 [...] NAME``
give the rank count and the hosts; data rows are

    size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong

(out-of-place, then in-place; time in µs, bandwidths in GB/s; older versions
have no ``root`` column). The JSON written by ``-J FILE`` holds the same rows
under ``results`` (``size``, ``count``, ``type``, ``redop``, ``root``,
``out_of_place``/``in_place`` with ``time``, ``alg_bw``, ``bus_bw``, ``nwrong``),
the command line under ``args`` and the devices under ``config.devices``.

The collective comes from the output (``# Collective test starting:
all_reduce_perf``, JSON ``args[0]``), else the file name, else an ``OP:`` prefix
on the argument (``all_reduce:run.txt``). The rank count comes from the device
lines, else from busbw/algbw (nccl-tests' own factor, inverted). Several hosts
among the devices make the samples ``inter_node``; a ``inter_node:`` prefix
forces it (output whose device lines were cut). Out-of-place times are used, as
nccl-tests users usually quote them; in-place ones where out-of-place is absent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.microbench.fit import Sample
from simulator.errors import Problem, UserError

# nccl-tests binary stem -> profile collective name (others are recognised and skipped)
OP_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather",
            "reduce_scatter": "reduce_scatter", "broadcast": "broadcast", "sendrecv": "send_recv",
            "send_recv": "send_recv", "alltoall": "all_to_all", "all_to_all": "all_to_all"}
OTHER_TESTS = ("reduce", "gather", "scatter", "hypercube")
LINKS = ("intra_node", "inter_node")
_RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device")


@dataclass(frozen=True)
class Row:
    size: int  # bytes
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw_GBps: float
    busbw_GBps: float


@dataclass(frozen=True)
class NcclTestsRun:
    op: str  # profile collective name
    nranks: int
    hosts: int
    link: str
    rows: tuple[Row, ...]
    source: str

    def samples(self) -> list[Sample]:
        return [Sample(self.op, self.nranks, float(r.size), r.time_us * 1e-6)
                for r in self.rows if r.time_us > 0]


def parse_spec(spec: str) -> tuple[str | None, str | None, Path]:
    """``[OP:][LINK:]FILE`` → (op, link, path)."""
    op = link = None
    rest = spec
    while ":" in rest:
        head, tail = rest.split(":", 1)
        if head in OP_NAMES and op is None:
            op = OP_NAMES[head]
        elif head in LINKS and link is None:
            link = head
        else:
            break
        rest = tail
    return op, link, Path(rest)


def load(spec: str) -> NcclTestsRun:
    op_hint, link_hint, path = parse_spec(spec)
    from simulator.loading import JSON_LIMIT_BYTES, read_bytes

    data = read_bytes(path, "--from-nccl-tests", JSON_LIMIT_BYTES)
    return parse(data.decode("utf-8", errors="replace"), str(path), op_hint, link_hint)


def parse(text: str, source: str, op_hint: str | None = None,
          link_hint: str | None = None) -> NcclTestsRun:
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UserError([Problem(
                "--from-nccl-tests", source, f"looks like JSON but does not parse ({exc.msg} at "
                f"line {exc.lineno}); pass the file nccl-tests -J wrote")]) from None
        except RecursionError:
            raise UserError([Problem("--from-nccl-tests", source, "is JSON nested too deeply; "
                                     "pass the file nccl-tests -J wrote")]) from None
        return _from_json(data, source, op_hint, link_hint)
    return _from_text(text, source, op_hint, link_hint)


def _op_name(candidates: list[str | None], source: str) -> str:
    for cand in candidates:
        if not cand:
            continue
        stem = Path(cand).name.lower()
        for name in sorted(OP_NAMES, key=len, reverse=True):
            if name in stem:
                return OP_NAMES[name]
        for other in OTHER_TESTS:
            if other in stem:
                raise UserError([Problem("--from-nccl-tests", source,
                                         f"{other} results have no place in a profile; pass "
                                         "all_reduce, all_gather, reduce_scatter, broadcast, "
                                         "sendrecv or alltoall results")])
    raise UserError([Problem("--from-nccl-tests", source,
                             "cannot tell which collective this is; prefix the file with it, "
                             "e.g. all_reduce:" + source)])


def _nranks(rows: list[Row], op: str, listed: int, source: str) -> int:
    if listed > 0:
        return listed
    from calibration.microbench.fit import busbw_factor

    big = [r for r in rows if r.algbw_GBps > 0]
    if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") and big:
        ratio = big[-1].busbw_GBps / big[-1].algbw_GBps
        n = round(2 / (2 - ratio)) if op == "all_reduce" else round(1 / max(1 - ratio, 1e-9))
        if n >= 2 and abs(busbw_factor(op, n) - ratio) < 0.02:
            return n
    if op in ("send_recv", "broadcast"):
        return 2
    raise UserError([Problem("--from-nccl-tests", source,
                             "cannot tell the number of ranks (no '#  Rank' device lines); "
                             "pass the complete output")])


def _link(hosts: int, hint: str | None) -> str:
    if hint:
        return hint
    return "inter_node" if hosts > 1 else "intra_node"


def _from_text(text: str, source: str, op_hint: str | None, link_hint: str | None) -> NcclTestsRun:
    ranks: dict[int, str] = {}
    name_line = None
    start: int | None = None  # column of the first (out-of-place) time, from the header
    rows: list[Row] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            words = s.lstrip("#").split()
            if m := _RANK_LINE.match(s):
                ranks[int(m.group(1))] = m.group(2)
            elif "Collective test starting:" in s:
                name_line = s.split(":", 1)[1].strip()
            elif words[:2] == ["size", "count"]:
                start = next((i for i, w in enumerate(words) if w in ("time", "cputime")), None)
            continue
        row = _text_row(s.split(), start)
        if row:
            rows.append(row)
    if not rows:
        raise UserError([Problem("--from-nccl-tests", source,
                                 "no result rows found (size count type redop root time algbw "
                                 "busbw ...); is this nccl-tests output?")])
    op = op_hint or _op_name([name_line, source], source)
    n = _nranks(rows, op, len(ranks), source)
    hosts = len(set(ranks.values()))
    return NcclTestsRun(op, n, hosts, _link(hosts, link_hint), tuple(rows), source)


def _num(tok: str) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


def _text_row(tok: list[str], start: int | None) -> Row | None:
    if len(tok) < 8 or not tok[0].isdigit() or not tok[1].isdigit():
        return None
    if start is None:  # no header seen: 13+ columns means the root column is there
        start = 5 if len(tok) >= 13 else 4
    out_of_place = [_num(t) for t in tok[start:start + 3]]
    in_place = [_num(t) for t in tok[start + 4:start + 7]]
    for perf in (out_of_place, in_place):
        if len(perf) == 3 and all(p is not None and p > 0 for p in perf[:1]) and None not in perf:
            t, alg, bus = (float(p) for p in perf if p is not None)
            return Row(int(tok[0]), int(tok[1]), tok[2], tok[3], t, alg, bus)
    return None


def _from_json(data: Any, source: str, op_hint: str | None, link_hint: str | None) -> NcclTestsRun:
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise UserError([Problem("--from-nccl-tests", source,
                                 "JSON without a 'results' list; pass the file nccl-tests -J "
                                 "wrote")])
    rows: list[Row] = []
    for r in data["results"]:
        perf = r.get("out_of_place") or r.get("in_place")
        if not isinstance(perf, dict):
            continue
        t = perf.get("time", perf.get("cpu_time"))
        if t is None:
            continue
        try:
            rows.append(Row(int(r["size"]), int(r.get("count", 0)), str(r.get("type", "")),
                            str(r.get("redop", "")), float(t), float(perf.get("alg_bw", 0)),
                            float(perf.get("bus_bw", 0))))
        except (KeyError, TypeError, ValueError):
            continue
    if not rows:
        raise UserError([Problem("--from-nccl-tests", source, "the JSON has no usable results")])
    args = data.get("args") or []
    op = op_hint or _op_name([args[0] if args else None, source], source)
    cfg = data.get("config") or {}
    devices = cfg.get("devices") or []
    per_entry = int(cfg.get("nthreads", 1) or 1) * int(cfg.get("ngpus", 1) or 1)
    listed = len(devices) * per_entry if devices else 0
    hosts = len({d.get("hostname") for d in devices if isinstance(d, dict)})
    n = _nranks(rows, op, listed, source)
    return NcclTestsRun(op, n, hosts, _link(hosts, link_hint), tuple(rows), source)
