"""Collective calibration appends each round as it is taken; a resumed run measures
exactly the rounds that are missing (the measuring function faked: no torch needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from calibration.microbench import collectives_worker as cw
from calibration.microbench.bench_results import ResultsStore

OPS = ("all_reduce", "all_gather")
SIZES = (1024, 4096, 16384)
ROUNDS = 3


def _args(results: Path) -> Any:
    return cw._parse([*(a for op in OPS for a in ("--op", op)),
                      "--sizes", ",".join(map(str, SIZES)), "--groups", "2",
                      "--results", str(results), "--rounds", str(ROUNDS)])


class FakeMeasure:
    """An α-β collective with no noise; interrupts (Ctrl-C) after ``stop_after`` rounds."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_after = stop_after

    def __call__(self, args: Any, store: Any, pt: Any, n: int, group: Any, dev: str,
                 rank: int) -> bool:
        if self.stop_after is not None and len(self.calls) == self.stop_after:
            raise KeyboardInterrupt
        self.calls.append((pt.key, len(pt.rounds)))
        if pt.k == 0:
            pt.k, pt.reps, pt.nbytes = 7, 3, pt.size
        pt.rounds.append(20e-6 + pt.size / 1e9)
        return True


def _sweep(store: ResultsStore, fake: FakeMeasure, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cw, "_measure_round", fake)
    args = _args(store.path)
    todo = [(op, s) for op in OPS for s in SIZES
            if cw.collective_key("cpu", 1, op, 2, s) not in store.done()]
    cw._sweep(args, store, 2, todo, None, "cpu", 0, cw.saved_rounds(store.records()))


def _finals(store: ResultsStore) -> dict[str, float]:
    return {r["key"]: r["time_s"] for r in store.records() if r["kind"] == "collective"}


@pytest.mark.parametrize("stop_after", [1, 5, 7, 17])
def test_interrupt_keeps_every_round_taken_and_resume_takes_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_after: int) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    first = FakeMeasure(stop_after)
    with pytest.raises(KeyboardInterrupt):
        _sweep(store, first, monkeypatch)
    saved = [r for r in store.records() if r["kind"] == "collective_round"]
    assert len(saved) == stop_after  # each round on disk the moment it was taken
    assert all(r["calls"] == 7 and r["reps"] == 3 for r in saved)

    second = FakeMeasure()
    _sweep(store, second, monkeypatch)
    planned = len(OPS) * len(SIZES) * ROUNDS
    assert len(second.calls) == planned - stop_after
    taken = {(k, i) for k, i in first.calls} | {(k, i) for k, i in second.calls}
    assert len(taken) == planned  # no round measured twice, none missing

    whole = ResultsStore(tmp_path / "whole.jsonl")
    _sweep(whole, FakeMeasure(), monkeypatch)
    assert _finals(store) == _finals(whole)


def test_a_finished_run_measures_nothing_again(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResultsStore(tmp_path / "r.jsonl")
    _sweep(store, FakeMeasure(), monkeypatch)
    again = FakeMeasure()
    _sweep(store, again, monkeypatch)
    assert again.calls == []


@pytest.mark.parametrize(("data", "words"), [
    ("x".encode("utf-16"), "UTF-16"), (b"ok \xe9", "not valid UTF-8"),
    (b"\x00\x01", "binary"),
])
def test_an_unreadable_results_file_is_one_line(tmp_path: Path, data: bytes, words: str) -> None:
    from simulator.errors import UserError

    path = tmp_path / "r.jsonl"
    path.write_bytes(data)
    with pytest.raises(UserError) as exc:
        ResultsStore(path).records()
    (line,) = exc.value.lines()
    assert words in line


def test_a_torn_or_hostile_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a", "ok": true}\n' + "[" * 100_000 + "\n{\"key\": \"b\"")
    assert [r["key"] for r in ResultsStore(path).records()] == ["a"]
