"""Pipeline schedules checked as data: closed-form bubbles, peak in-flight, golden grids."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

import simulator.schedules.registry as schedules_module
from simulator.analysis.analytic.stage import pipeline_time
from simulator.model.memory import in_flight_microbatches
from simulator.schedules.action import Action, Schedule, TimedAction, bubble_fraction, execute
from simulator.schedules.gpipe import gpipe
from simulator.schedules.interleaved import interleaved_1f1b
from simulator.schedules.one_f_one_b import one_f_one_b
from simulator.schedules.registry import SCHEDULES, build_schedule, requirements
from simulator.schedules.spec import ScheduleSpec
from simulator.schedules.validate import validate
from simulator.schedules.zb_h1 import zb_h1

PS = [1, 2, 3, 4, 5, 8]
MS = [1, 2, 3, 4, 7, 8, 16]
GRID = list(itertools.product(PS, MS))
INTERLEAVED = [(p, m, v) for p, m in GRID for v in (2, 3, 4) if m % p == 0]
TIMES = [(1.0, 2.0), (1.0, 1.0), (1.3, 2.9)]


def idle_per_rank(timed: list[TimedAction], p: int) -> list[float]:
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    busy = [0.0] * p
    for t in timed:
        busy[t.rank] += t.end - t.start
    return [makespan - b for b in busy]


def all_schedules() -> list[Schedule]:
    built = [b(p, m) for p, m in GRID for b in (gpipe, one_f_one_b, zb_h1)]
    return built + [interleaved_1f1b(p, m, v) for p, m, v in INTERLEAVED]


def schedule_id(s: Schedule) -> str:
    return f"{s.name}-p{s.stages}-m{s.microbatches}-v{s.virtual_stages}"


# --- closed forms -------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("t_f", "t_b"), TIMES)
def test_gpipe_and_1f1b_bubble(builder, p, m, t_f, t_b):
    timed = execute(builder(p, m), t_f=t_f, t_b=t_b)
    assert bubble_fraction(timed, p) == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    for idle in idle_per_rank(timed, p):
        assert idle == pytest.approx((p - 1) * (t_f + t_b), abs=1e-9)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight_gpipe_and_1f1b(p, m):
    g, f = gpipe(p, m), one_f_one_b(p, m)
    assert [g.peak_in_flight(r) for r in range(p)] == [m] * p
    assert [f.peak_in_flight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
@pytest.mark.parametrize(("t_f", "t_b"), TIMES)
def test_interleaved_bubble(p, m, v, t_f, t_b):
    timed = execute(interleaved_1f1b(p, m, v), t_f=t_f / v, t_b=t_b / v)
    expected = ((p - 1) / v) / (m + (p - 1) / v)
    assert bubble_fraction(timed, p) == pytest.approx(expected, abs=1e-9)
    for idle in idle_per_rank(timed, p):
        assert idle == pytest.approx((p - 1) * (t_f + t_b) / v, abs=1e-9)


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_peak_follows_megatron_warmup(p, m, v):
    schedule = interleaved_1f1b(p, m, v)
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        assert schedule.peak_in_flight(r) == min(warmup + 1, m * v)
    # rank 0 in units of whole micro-batches: p + (p - 1) / v (Narayanan et al. SC'21), when m > p
    if m > p:
        assert schedule.peak_in_flight(0) / v == pytest.approx(p + (p - 1) / v)


def test_interleaved_order_groups_p_microbatches_per_chunk():
    order = [str(a) for a in interleaved_1f1b(2, 4, 2).actions[0] if a.kind == "F"]
    assert order == ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    backward = [str(a) for a in interleaved_1f1b(2, 4, 2).actions[0] if a.kind == "B"]
    assert backward == ["2B0", "2B1", "0B0", "0B1", "2B2", "2B3", "0B2", "0B3"]


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p])
@pytest.mark.parametrize(("t_f", "t_b", "t_w"), [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0)])
def test_zb_h1_bubble(p, m, t_f, t_b, t_w):
    zb_idle = idle_per_rank(execute(zb_h1(p, m), t_f=t_f, t_b=t_b, t_w=t_w), p)
    ofob_idle = idle_per_rank(execute(one_f_one_b(p, m), t_f=t_f, t_b=t_b, t_w=t_w), p)
    for zb, ofob in zip(zb_idle, ofob_idle, strict=True):
        assert zb == pytest.approx((p - 1) * (t_f + t_b - t_w), abs=1e-9)
        assert ofob == pytest.approx((p - 1) * (t_f + t_b + t_w), abs=1e-9)
        if t_f == t_b == t_w:
            assert zb == pytest.approx(ofob / 3, abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m < p])
def test_zb_h1_short_pipeline_hides_only_m_minus_1_weight_grads(p, m):
    # With m < p only m - 1 W's can fill the drain: idle = (p-1)(t_f+t_b) - (m-1) t_w.
    for idle in idle_per_rank(execute(zb_h1(p, m), t_f=1.0, t_b=1.0, t_w=1.0), p):
        assert idle == pytest.approx(2 * (p - 1) - (m - 1), abs=1e-9)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1_peak_in_flight_matches_1f1b(p, m):
    schedule = zb_h1(p, m)
    assert [schedule.peak_in_flight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]
    # weight-gradient inputs are held until W: min(p, m) everywhere = 1F1B's rank-0 peak
    assert [schedule.peak_in_flight(r, until="W") for r in range(p)] == [min(p, m)] * p


# --- executor -----------------------------------------------------------------------------


def test_execute_adds_comm_only_across_ranks():
    timed = execute(gpipe(2, 1), t_f=1.0, t_b=2.0, comm=0.5)
    assert [(str(t.action), t.rank, t.start, t.end) for t in timed] == [
        ("0F0", 0, 0.0, 1.0),
        ("1F0", 1, 1.5, 2.5),
        ("1B0", 1, 2.5, 4.5),
        ("0B0", 0, 5.0, 7.0),
    ]


def test_execute_interleaved_single_rank_has_no_comm():
    timed = execute(interleaved_1f1b(1, 1, 2), t_f=1.0, t_b=1.0, comm=10.0)
    assert max(t.end for t in timed) == 4.0


@pytest.mark.parametrize("schedule", all_schedules(), ids=schedule_id)
def test_execute_respects_dependencies(schedule):
    comm = 0.25
    timed = execute(schedule, t_f=1.0, t_b=1.5, t_w=0.5, comm=comm)
    end = {t.action: t.end for t in timed}
    rank = {t.action: t.rank for t in timed}
    assert len(end) == sum(len(order) for order in schedule.actions)
    for t in timed:
        a = t.action
        deps = []
        if a.kind == "F" and a.stage > 0:
            deps.append(Action(a.stage - 1, "F", a.microbatch))
        if a.kind in "BI":
            deps.append(Action(a.stage, "F", a.microbatch))
            if a.stage < schedule.total_stages - 1:
                nxt = [Action(a.stage + 1, k, a.microbatch) for k in "BI"]
                deps += [d for d in nxt if d in end]
        if a.kind == "W":
            deps.append(Action(a.stage, "I", a.microbatch))
        for d in deps:
            assert t.start >= end[d] + (comm if rank[d] != t.rank else 0.0) - 1e-12


def test_bubble_fraction_rejects_empty_input():
    with pytest.raises(ValueError, match="at least one"):
        bubble_fraction([], 2)


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", all_schedules(), ids=schedule_id)
def test_every_built_schedule_validates(schedule):
    validate(schedule)


def parse_ranks(*ranks: str) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(Action.parse(text) for text in rank.split()) for rank in ranks)


def test_validate_rejects_backward_before_forward():
    broken = Schedule("hand", 2, 1, 1, parse_ranks("0B0 0F0", "1F0 1B0"))
    with pytest.raises(ValueError, match="rank 0 runs 0B0 before its dependency 0F0"):
        validate(broken)


def test_validate_rejects_weight_grad_before_input_grad():
    broken = Schedule("hand", 1, 1, 1, parse_ranks("0F0 0W0 0I0"))
    with pytest.raises(ValueError, match="0W0 before its dependency 0I0"):
        validate(broken)


def test_validate_rejects_missing_action():
    broken = Schedule("hand", 2, 2, 1, parse_ranks("0F0 0F1 0B0 0B1", "1F0 1F1 1B0"))
    with pytest.raises(ValueError, match="stage 1 micro-batch 1 has B=0, I=0, W=0"):
        validate(broken)


def test_validate_rejects_duplicate_and_misplaced_actions():
    twice = Schedule("hand", 1, 1, 1, parse_ranks("0F0 0F0 0B0"))
    with pytest.raises(ValueError, match="2 F actions"):
        validate(twice)
    misplaced = Schedule("hand", 2, 1, 1, parse_ranks("0F0 1F0 0B0 1B0", ""))
    with pytest.raises(ValueError, match="rank 0 runs 1F0"):
        validate(misplaced)


def test_validate_rejects_cyclic_deadlock():
    cyclic = Schedule("hand", 2, 2, 1, parse_ranks("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"))
    with pytest.raises(ValueError, match=r"deadlock: rank 0 waits at 0B0 for 1B0; rank 1 waits"):
        validate(cyclic)


# --- golden grids -------------------------------------------------------------------------


def test_golden_grid_gpipe_2x2():
    assert gpipe(2, 2).grid() == "\n".join(
        [
            "step  rank 0  rank 1",
            "   0  0F0",
            "   1  0F1     1F0",
            "   2          1F1",
            "   3          1B0",
            "   4  0B0     1B1",
            "   5  0B1",
        ]
    )


def test_golden_grid_1f1b_3x4():
    assert one_f_one_b(3, 4).grid() == "\n".join(
        [
            "step  rank 0  rank 1  rank 2",
            "   0  0F0",
            "   1  0F1     1F0",
            "   2  0F2     1F1     2F0",
            "   3                  2B0",
            "   4          1B0     2F1",
            "   5  0B0     1F2     2B1",
            "   6  0F3     1B1     2F2",
            "   7  0B1     1F3     2B2",
            "   8          1B2     2F3",
            "   9  0B2             2B3",
            "  10          1B3",
            "  11  0B3",
        ]
    )


# --- actions, registry, placement ---------------------------------------------------------


@given(
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from(["F", "B", "I", "W"]),
    st.integers(min_value=0, max_value=10_000),
)
def test_action_text_round_trip(stage, kind, microbatch):
    action = Action(stage, kind, microbatch)
    assert Action.parse(str(action)) == action
    assert str(Action.parse(str(action))) == str(action)


def test_action_prints_like_pytorch():
    assert str(Action(2, "F", 0)) == "2F0"
    assert Action.parse("12W103") == Action(12, "W", 103)


@pytest.mark.parametrize("text", ["", "2X0", "F0", "2F", "-1F0", "2 F0", "2f0", "2F0x"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_registry_and_dispatch():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipe"}
    assert build_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert build_schedule("interleaved", 4, 8, v=3) == interleaved_1f1b(4, 8, 3)
    with pytest.raises(ValueError, match="valid: 1f1b, dualpipe, gpipe, interleaved, zb-h1, zbv"):
        build_schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match="v=2"):
        build_schedule("gpipe", 4, 8, v=2)


def _runnable(name: str) -> list[tuple[int, int, int]]:
    lo, hi = SCHEDULES[name].chunks
    chunks = range(lo, (hi or 4) + 1)
    return [(p, m, v) for p, m in GRID for v in chunks if not requirements(name, p, m, v)
            and (name != "zb-h1" or m >= p)]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_registry_pipeline_time_is_the_executed_makespan(name):
    """Each entry's closed form is the list-scheduled makespan of the schedule it builds
    (stage times f, b, w; a chunk takes 1/v of them, or with two directions, where a
    micro-batch passes one of a rank's two chunks, all of them)."""
    f, b, w = (1.0, 2.0, 0.7) if name == "zb-h1" else (1.3, 2.9, 0.0)
    for p, m, v in _runnable(name):
        k = SCHEDULES[name].directions / v
        timed = execute(build_schedule(name, p, m, v), t_f=f * k, t_b=b * k, t_w=w * k)
        makespan = max(t.end for t in timed) - min(t.start for t in timed)
        assert pipeline_time(name, p, m, v, f, b, w) == pytest.approx(makespan, rel=1e-12)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_registry_requirements_are_what_the_builder_needs(name):
    """Every (p, m, v) the registry accepts builds and validates; what it rejects the
    builder rejects too."""
    for p, m in GRID:
        for v in (1, 2, 3):
            if requirements(name, p, m, v):
                with pytest.raises(ValueError):
                    build_schedule(name, p, m, v)
            else:
                validate(build_schedule(name, p, m, v))


def test_registry_requirements_name_the_fix():
    (chunks,) = requirements("gpipe", 4, 8, 2)
    assert chunks.field == "virtual_stages" and "only with schedule: interleaved" in chunks.text
    (few,) = requirements("interleaved", 4, 8, 1)
    assert few.field == "virtual_stages" and few.text == "interleaved needs virtual_stages >= 2"
    (batch,) = requirements("interleaved", 4, 6, 2)
    assert (batch.field, batch.multiple) == ("microbatches", 4) and "(m = 6)" in batch.text
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        requirements("pipedream", 4, 8, 1)


def test_a_new_schedule_is_one_registry_entry(monkeypatch):
    """Registering an entry is all that building, memory and the analytic time need."""
    entry = ScheduleSpec(lambda p, m, v: gpipe(p, m), lambda p, m, v, stage: float(m),
                         lambda p, m, v, f, b, w: (m + p - 1) * (f + b + w) + 1.0)
    monkeypatch.setattr(schedules_module, "SCHEDULES", {**SCHEDULES, "gpipe-again": entry})
    assert build_schedule("gpipe-again", 3, 5) == gpipe(3, 5)
    assert in_flight_microbatches("gpipe-again", 3, 5, 1, 2) == 5.0
    assert pipeline_time("gpipe-again", 3, 5, 1, 1.0, 2.0, 0.0) == 22.0
    assert requirements("gpipe-again", 3, 5, 1) == []
    (chunks,) = requirements("gpipe-again", 3, 6, 2)
    assert "only with schedule: interleaved" in chunks.text


def test_interleaved_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"m mod N = 2 < p=4 micro-batches \(m=6, N=4\)"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="v=1"):
        interleaved_1f1b(4, 8, 1)
    with pytest.raises(ValueError, match="p=0"):
        gpipe(0, 4)


def test_virtual_stage_placement():
    schedule = interleaved_1f1b(4, 8, 3)
    assert [schedule.rank_of(s) for s in (0, 3, 4, 9, 11)] == [0, 3, 0, 1, 3]
    assert [schedule.chunk_of(s) for s in (0, 3, 4, 9, 11)] == [0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="stage 12 outside"):
        schedule.rank_of(12)
