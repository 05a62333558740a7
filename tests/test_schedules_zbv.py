"""ZB-V as schedule data: PyTorch's handcrafted order (``ScheduleZBVZeroBubble``), the V
placement, its in-flight activations and its bubble in closed form."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.memory import stage_breakdown
from simulator.model.memory import stage_params
from simulator.model.transformer import head_params
from simulator.schedules.action import execute
from simulator.schedules.registry import SCHEDULES
from simulator.schedules.validate import validate
from simulator.schedules.zbv import zbv, zbv_idle, zbv_in_flight_chunks
from simulator.spec.load import load_scenario
from simulator.spec.placement import head_rank, stage_layers
from simulator.spec.scenario import Scenario


def idle_per_rank(p: int, m: int, f: float, b: float, w: float) -> list[float]:
    timed = execute(zbv(p, m), t_f=f, t_b=b, t_w=w)
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    busy = [0.0] * p
    for t in timed:
        busy[t.rank] += t.end - t.start
    return [makespan - x for x in busy]


def test_p2_m4_order_by_hand_from_the_rule():
    # rank 0 (stages 0 and 3): 3 F0; F1 I1 W1 twice; loop (F0) I0 W0 F1 I1 W1; I0 W0 twice
    schedule = zbv(2, 4)
    rank0 = ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 "
             "3F3 3I3 3W3 0I2 0W2 0I3 0W3")
    # rank 1 (stages 1 and 2): 1 F0; F1 F0; F1 I1 W1; loop twice; I0 I1; I0 W0; W1; W0
    rank1 = ("1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 "
             "1I2 2I3 1I3 1W2 2W3 1W3")
    assert " ".join(map(str, schedule.actions[0])) == rank0
    assert " ".join(map(str, schedule.actions[1])) == rank1


def test_v_placement_puts_both_ends_on_rank_0():
    schedule = zbv(4, 8)
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [schedule.chunk_of(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24))
def test_valid_and_in_flight_closed_form(p, m):
    schedule = zbv(p, m)
    validate(schedule)
    for rank in range(p):
        assert schedule.peak_in_flight(rank) == zbv_in_flight_chunks(p, m, rank)
        assert schedule.peak_in_flight(rank, until="W") == zbv_in_flight_chunks(p, m, rank)
    if m >= 2 * p - 1:  # 1F1B's rank-0 peak, p whole stages, on every rank
        assert {schedule.peak_in_flight(r) / 2 for r in range(p)} == {p}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 8), st.floats(0.1, 3.0), st.floats(0.0, 3.0),
       st.floats(0.0, 3.0))
def test_idle_closed_form_for_w_le_f_le_b(p, extra, w, df, db):
    f, m = w + df, 2 * p - 1 + extra
    b = f + db
    for idle in idle_per_rank(p, m, f, b, w):
        assert idle == pytest.approx(zbv_idle(p, f, b, w), abs=1e-9)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_equal_times_leave_only_the_warmup_slots(p, extra):
    # F = I = W = t: the makespan is 6 m t + (p − 1) t, rank p − 1's first forward
    # cannot start before p − 1 others ran (the paper's zero bubble beyond them)
    m, t = 2 * p - 1 + extra, 0.7
    timed = execute(zbv(p, m), t_f=t, t_b=t, t_w=t)
    assert max(x.end for x in timed) == pytest.approx(6 * m * t + (p - 1) * t)


# --- through the model: the V placement in memory -----------------------------------------

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "zb-h1-vs-1f1b-zbh1.yaml"


def _scenario(schedule: str, v: int, tied: bool = False) -> Scenario:
    sets = ["parallel.pp=4", "parallel.dp=2", f"parallel.schedule={schedule}",
            f"parallel.virtual_stages={v}", f"model.tied_embeddings={str(tied).lower()}"]
    return load_scenario(SCENARIO, sets)


def test_memory_puts_the_output_layer_on_rank_0():
    loop, vee = _scenario("interleaved", 2), _scenario("zbv", 2)
    spec = loop.model
    head = head_params(spec)
    # the same layers per rank (2 chunks of 40/8), the head moved from rank 3 to rank 0
    assert stage_params(spec, 4, 0, stage_layers(40, vee.parallel, 0), head_rank(vee.parallel)) \
        == stage_params(spec, 4, 0, stage_layers(40, loop.parallel, 0)) + head
    for rank in (1, 2):
        assert stage_breakdown(vee, rank).weights == stage_breakdown(loop, rank).weights
    assert stage_breakdown(vee, 0).logits > 0 == stage_breakdown(vee, 3).logits
    assert stage_breakdown(loop, 3).logits == stage_breakdown(vee, 0).logits
    # V: rank r holds stages r and 7 - r
    assert stage_layers(40, vee.parallel, 1) == [range(5, 10), range(30, 35)]


def test_a_tied_embedding_needs_no_copy_when_both_ends_share_rank_0():
    loop, vee = _scenario("interleaved", 2, tied=True), _scenario("zbv", 2, tied=True)
    copy = loop.model.vocab * loop.model.hidden
    held = [stage_params(s.model, 4, r, stage_layers(40, s.parallel, r), head_rank(s.parallel))
            for s in (loop, vee) for r in (0, 3)]
    loop0, loop3, vee0, vee3 = held
    head = head_params(loop.model)  # tied: the final norm; the output layer is the embedding
    assert vee0 == loop0 + head  # rank 0 gains the head and needs no copy of the embedding
    assert vee3 == loop3 - head - copy  # the last rank loses the head and Megatron's copy


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.floats(0.0, 3.0), st.floats(0.0, 3.0),
       st.floats(0.0, 3.0))
def test_registry_time_is_the_executed_makespan_for_any_times(p, m, f, b, w):
    # outside the closed form's region the registry places 2p − 1 micro-batches and adds
    # the rest at full rate: the idle time stops growing once m >= 2p − 1
    timed = execute(zbv(p, m), t_f=f / 2, t_b=b / 2, t_w=w / 2)
    makespan = max(t.end for t in timed) - min(t.start for t in timed)
    assert SCHEDULES["zbv"].pipeline_time(p, m, 2, f, b, w) == pytest.approx(makespan,
                                                                            abs=1e-9)
