"""The column-wise span table equals a row-per-span reference, in both fidelities."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from simulator.analysis.memory_timeline import memory_timeline
from simulator.builder.workload import build_workload
from simulator.engine.engine import simulate
from simulator.outputs.span_table import SPAN_COLUMNS, span_table, stage_representatives
from simulator.spec.load import scenario_from_dict

SMALL = {
    "name": "small", "model": {"preset": "tiny-gpt"},
    "cluster": {"system": "dgx-a100-80gb", "nodes": 1, "gpus_per_node": 8},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "schedule": "1f1b"},
    "training": {"global_batch": 16, "micro_batch": 2, "dtype": "bf16"},
}


def reference(result) -> pd.DataFrame:  # type: ignore[no-untyped-def]
    """The span table the slow way: one Python row per span (what the engine left)."""
    tasks, layout = result.workload.tasks, result.workload.layout
    rows = []
    for tid, start, end in result.spans:
        t, c = tasks[tid], layout.coord(tasks[tid].rank)
        rows.append((t.rank, c.pp, c.tp, c.dp, t.stream, t.op, t.kind, t.name, t.microbatch,
                     t.layer, t.chunk, start, result.comm_start.get(tid, start), end, t.nbytes,
                     tid, t.weight_s))
    df = pd.DataFrame(rows, columns=list(SPAN_COLUMNS))
    return df.sort_values(["rank", "start", "end"], kind="stable").reset_index(drop=True)


@pytest.mark.parametrize("fidelity", ["folded", "full"])
def test_columns_equal_the_row_reference(fidelity: str) -> None:
    s = scenario_from_dict(SMALL)
    result = simulate(build_workload(s, fidelity=fidelity), s.hardware)
    table = span_table(result)
    expected = reference(result)
    assert list(table.columns) == list(SPAN_COLUMNS)
    assert len(table) == len(result.spans) == len(result.workload.tasks)
    for column, dtype in SPAN_COLUMNS.items():
        assert str(table[column].dtype) == dtype, column
        got = table[column].astype(str) if dtype == "category" else table[column]
        want = expected[column].astype(str) if dtype == "category" else expected[column]
        # ties in (rank, start, end) may be ordered differently: compare by task
        got = got.set_axis(table["task"]).sort_index()
        want = want.set_axis(expected["task"]).sort_index()
        pd.testing.assert_series_equal(got, want.astype(got.dtype), check_names=False)
    keys = table[["rank", "start", "end"]].to_numpy()
    assert (pd.DataFrame(keys).sort_values([0, 1, 2]).to_numpy() == keys).all()
    assert table["task"].is_unique


def test_the_table_holds_each_column_once() -> None:
    """One block per column: a frame consolidated by dtype copies every column once
    more while it is built (1.2 GB at GPT-3 on 1,024 GPUs, full fidelity)."""
    s = scenario_from_dict(SMALL)
    table = span_table(simulate(build_workload(s, fidelity="full"), s.hardware))
    assert table._mgr.nblocks == len(SPAN_COLUMNS)


def test_stage_representatives_are_each_stages_lowest_rank() -> None:
    s = scenario_from_dict(SMALL)
    table = span_table(simulate(build_workload(s, fidelity="full"), s.hardware))
    assert stage_representatives(table) == [0, 4]
    assert stage_representatives(table[table["rank"] != 4]) == [0, 5]
    assert stage_representatives(table.iloc[:0]) == []


@pytest.mark.parametrize("overrides", [
    {}, {"parallel": {"tp": 2, "pp": 2, "dp": 2, "zero": 3, "schedule": "gpipe"}},
    {"parallel": {"tp": 1, "pp": 2, "dp": 4, "schedule": "interleaved", "virtual_stages": 2}},
])
def test_memory_curves_from_the_table_equal_those_from_the_engine_spans(
        overrides: dict[str, Any]) -> None:
    s = scenario_from_dict({**SMALL, **overrides})
    result = simulate(build_workload(s, fidelity="full"), s.hardware)
    table = span_table(result)
    for ranks in ([0, 4], None):
        assert memory_timeline(s, result, ranks=ranks, spans=table) == \
            memory_timeline(s, result, ranks=ranks)
