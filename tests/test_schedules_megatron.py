"""The interleaved schedule against Megatron-Core's own order.

Oracles are tables written out by hand from ``megatron/core/pipeline_parallel/schedules.py``
(``get_schedule_table``, ``get_pp_rank_microbatches`` and the warm-up / steady / cooldown
loops of ``forward_backward_pipelining_with_interleaving``) and the examples in its
comments and in ``ModelParallelConfig.microbatch_group_size_per_vp_stage``'s docstring.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.schedules.interleaved import (
    group_problem,
    interleaved_1f1b,
    schedule_table,
    warmup_forwards,
)
from simulator.schedules.validate import validate


def test_schedule_table_is_megatrons_comment_example():
    # schedules.py: "the tunable schedule table for PP2 N3M5 with VP2"
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # model_parallel_config.py: "PP=2 VP=2, when microbatch_group_size_per_vp_stage=2,
    # num_microbatches = 4": rank 0 | 0 1 0 1 2 3 2 3
    assert [mb for mb, _ in schedule_table(4, 2, 2)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_p2_m5_v2_n3_order_from_the_warmup_steady_and_cooldown_loops():
    # rank 0 warms up with 2(2-0-1) + (2-1)·3 = 5 forwards, rank 1 with 3; then forward
    # k + warmup and backward k in turn; backwards use the table with chunks reversed.
    schedule = interleaved_1f1b(2, 5, 2, group=3)
    rank0 = "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4"
    rank1 = "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4"
    assert " ".join(map(str, schedule.actions[0])) == rank0
    assert " ".join(map(str, schedule.actions[1])) == rank1
    validate(schedule)


def test_m_equal_p_runs_some_ranks_all_warmup():
    # p = m = 4, v = 2: ranks 0 and 1 have 2(p-r-1) + p >= m·v = 8 (Megatron's
    # are_all_microbatches_in_warmup): every forward, then every backward
    schedule = interleaved_1f1b(4, 4, 2)
    assert [warmup_forwards(4, 4, 2, r) for r in range(4)] == [8, 8, 6, 4]
    for rank in (0, 1):
        kinds = "".join(a.kind for a in schedule.actions[rank])
        assert kinds == "F" * 8 + "B" * 8
    assert "".join(a.kind for a in schedule.actions[2]) == "F" * 6 + "FB" * 2 + "B" * 6


@pytest.mark.parametrize(("p", "m", "n", "fix"), [
    (4, 6, 4, "m mod N = 2 < p=4"), (4, 8, 3, "N=3 must lie in [p=4, m=8]"),
    (2, 3, 4, "N=4 must lie in [p=2, m=3]"),
])
def test_megatron_refuses_groups_it_refuses(p, m, n, fix):
    assert fix in (group_problem(p, m, n) or "")
    with pytest.raises(ValueError, match="interleaved 1F1B: "):
        interleaved_1f1b(p, m, 2, group=n)


@given(p=st.integers(1, 6), v=st.integers(2, 4), extra=st.integers(0, 7),
       data=st.data())
def test_any_group_megatron_accepts_gives_a_valid_schedule(p, v, extra, data):
    m = p + extra
    n = data.draw(st.integers(p, m))
    if group_problem(p, m, n) is not None:
        assert 0 < m % n < p
        return
    schedule = interleaved_1f1b(p, m, v, group=n)
    validate(schedule)
    for rank in range(p):
        warmup = warmup_forwards(p, m, v, rank, n)
        assert warmup == min(2 * (p - rank - 1) + (v - 1) * n, m * v)
        assert schedule.peak_in_flight(rank) == min(warmup + 1, m * v)
        forwards = [(a.microbatch, a.stage // p) for a in schedule.actions[rank]
                    if a.kind == "F"]
        assert forwards == schedule_table(m, v, n)
