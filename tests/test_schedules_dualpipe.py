"""DualPipe as schedule data: the order of ``DualPipe.step`` (deepseek-ai/DualPipe,
``dualpipe/dualpipe.py``), its placement, its in-flight activations and its bubble."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.schedules.action import execute
from simulator.schedules.dualpipe import dualpipe, dualpipe_in_flight, dualpipe_problem
from simulator.schedules.registry import SCHEDULES
from simulator.schedules.validate import validate

SIZES = st.integers(1, 5).flatmap(
    lambda half: st.tuples(st.just(2 * half), st.integers(2 * half, 6 * half).map(
        lambda m2: 2 * m2)))


def idle_per_rank(p: int, m: int, f: float, b: float, w: float) -> list[float]:
    timed = execute(dualpipe(p, m), t_f=f, t_b=b, t_w=w)
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    busy = [0.0] * p
    for t in timed:
        busy[t.rank] += t.end - t.start
    return [makespan - x for x in busy]


def test_p4_m8_order_is_dualpipe_steps_by_hand():
    # rank 0 (half_rank 0, near = direction 0, stages 0 and 7; direction 1 = mb 4..7):
    # step 1: 2 F near; 2: F near, F far; 3: I far, W, F far; 4 (m/2 - p + 1 = 1):
    # F near + B far, F far + B near; 5: B far, F far + B near; 6: B far, then (from
    # the middle of the step) I near; 7: W, I near; 8: W
    schedule = dualpipe(4, 8)
    rank0 = "0F0 0F1 0F2 7F4 7I4 7W4 7F5 0F3 7B5 7F6 0B0 7B6 7F7 0B1 7B7 0I2 0W2 0I3 0W3"
    assert " ".join(map(str, schedule.actions[0])) == rank0
    # rank 3 mirrors rank 0: its near direction is 1 (fed at rank 3), stage 4 of it
    mirrored = " ".join(map(str, schedule.actions[3]))
    assert mirrored.startswith("4F4 4F5 4F6 3F0 3I0 3W0 3F1 4F7 3B1")


def test_placement_is_two_model_stages_per_rank():
    schedule = dualpipe(4, 8)
    # direction 0 runs virtual stages 0..3 on ranks 0..3, direction 1 stages 4..7 on 3..0
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert schedule.route(3) == range(0, 4) and schedule.route(4) == range(4, 8)
    # each rank holds model stage r and p - 1 - r: twice the parameters (Table 2: 2×)
    held = [{s % 4 for s in range(8) if schedule.rank_of(s) == r} for r in range(4)]
    assert held == [{0, 3}, {1, 2}, {1, 2}, {0, 3}]


@pytest.mark.parametrize(("p", "m", "text"), [
    (3, 6, "even number of pipeline ranks; got p=3"),
    (4, 6, "m >= 2p = 8; got m=6"), (4, 9, "m >= 2p = 8; got m=9"),
])
def test_refuses_what_dualpipe_step_asserts(p, m, text):
    assert text in (dualpipe_problem(p, m) or "")
    with pytest.raises(ValueError, match=text.split(";")[0]):
        dualpipe(p, m)


@settings(max_examples=40, deadline=None)
@given(SIZES)
def test_valid_and_holds_p_plus_1_chunks_on_every_rank(sizes):
    p, m = sizes
    schedule = dualpipe(p, m)
    validate(schedule)
    for rank in range(p):
        assert schedule.peak_in_flight(rank) == dualpipe_in_flight(p) == p + 1
        assert schedule.peak_in_flight(rank, until="W") == p + 1
    for order in schedule.actions:  # each direction in micro-batch order
        for kinds in ("F", "BI"):
            for d in (0, 1):
                mbs = [a.microbatch for a in order
                       if a.kind in kinds and a.stage in schedule.route(d * m // 2)]
                assert mbs == sorted(mbs) and len(mbs) == m // 2


@settings(max_examples=25, deadline=None)
@given(SIZES, st.floats(0.5, 3.0))
def test_equal_times_idle_p_half_minus_1_slots_on_every_rank(sizes, t):
    # F = I = W = t: every rank idles (p/2 − 1) t whatever m (the report's
    # (PP/2 − 1)(F&B + B − 3W) with F&B = B = 2t: the pair costs its backward)
    p, m = sizes
    for idle in idle_per_rank(p, m, t, t, t):
        assert idle == pytest.approx((p / 2 - 1) * t, abs=1e-9)


@pytest.mark.parametrize(("f", "b", "w"), [(1.0, 2.0, 1.0), (1.3, 2.9, 1.1), (1.0, 1.0, 0.2)])
@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_bubble_does_not_grow_with_m(p, f, b, w):
    first = idle_per_rank(p, 2 * p, f, b, w)
    assert max(first) - min(first) == pytest.approx(0.0, abs=1e-9)
    for m in (2 * p + 2, 4 * p, 4 * p + 6):
        assert idle_per_rank(p, m, f, b, w) == pytest.approx(first, abs=1e-9)
    if p == 2:
        assert first == pytest.approx([0.0, 0.0], abs=1e-9)



@settings(max_examples=40, deadline=None)
@given(SIZES, st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0))
def test_registry_time_is_the_executed_makespan_for_any_times(sizes, f, b, w):
    # the registry places 2p micro-batches and adds the rest at full rate (a chunk's
    # times: each micro-batch passes one of a rank's two chunks)
    p, m = sizes
    timed = execute(dualpipe(p, m), t_f=f, t_b=b, t_w=w)
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    assert SCHEDULES["dualpipe"].pipeline_time(p, m, 2, f, b, w) == pytest.approx(
        makespan, rel=1e-9, abs=1e-9)
