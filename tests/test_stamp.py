"""Block stamping (:mod:`simulator.builder.stamp`) against building every action.

The builder builds the first two actions of each (rank, kind, stage) with the passes and
copies the first for every other micro-batch. The copied program must equal the one
built action by action, exactly: every field of every task (floats compared bit for
bit), its plan, and every stream's order; and stamping must really have happened where
the passes allow it, and not where a pass carries state between actions (ZeRO-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.builder import stamp
from simulator.builder.tasks import Workload
from simulator.builder.workload import build_workload
from simulator.spec.load import load_scenario, scenario_from_dict
from tests.test_workload_golden import FIELDS

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
GPT = {"layers": 4, "hidden": 128, "heads": 8, "vocab": 512, "seq_len": 64}
MOE = {**GPT, "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 256,
       "first_dense_layers": 1}

# (scenario, --set overrides, fidelity, whether any action is copied)
CASES: list[tuple[str, tuple[str, ...], str, bool]] = [
    ("interleaved-vs-1f1b-interleaved", ("training.global_batch=8",), "folded", True),
    ("zb-h1-vs-1f1b-zbh1", (), "folded", True),
    ("interleaved-vs-1f1b-1f1b", ("training.global_batch=4", "parallel.sequence_parallel=true",
                                  "parallel.recompute=full", "stack.tp_overlap=pipelined"),
     "folded", True),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.recompute=full", "parallel.recompute_every=2"),
     "folded", True),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.recompute=full", "parallel.recompute_num_layers=3",
                                 "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                 "training.global_batch=8"), "folded", True),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.zero=3",), "folded", False),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.schedule=zb-h1", "parallel.zero=3",
                                 "parallel.recompute=full"), "full", False),
    ("llama2-7b-8gpu-pp4-gpipe", (), "full", True),
    ("llama3-8b-8xh100-torchtitan", ("parallel.tp=2", "parallel.dp=4", "parallel.zero=1",
                                     "parallel.sequence_parallel=true",
                                     "training.global_batch=32"), "folded", True),
    ("gpt3-175b-1024-slow-gpu", ("training.global_batch=64",), "folded", True),
]


def exact(w: Workload) -> list[Any]:
    """Everything the engine and the reports read, floats by their bits."""
    out: list[Any] = [(*(repr(getattr(t, f)) for f in FIELDS), t.plan) for t in w.tasks]
    for rank, program in sorted(w.programs.items()):
        for name, tasks in program.streams.items():
            out.append((rank, name, [t.id for t in tasks]))
    return out


def both(s: Any, fidelity: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Workload, Workload,
                                                                             int]:
    """The workload stamped and built action by action, and how many actions were copied."""
    copied = [0]
    replay = stamp.Stamps.replay

    def counted(self: stamp.Stamps, *args: Any) -> Any:
        copied[0] += 1
        return replay(self, *args)

    monkeypatch.setattr(stamp.Stamps, "replay", counted)
    stamped = build_workload(s, fidelity=fidelity)
    built = build_workload(s, fidelity=fidelity, stamp=False)
    return stamped, built, copied[0]


@pytest.mark.parametrize(("name", "sets", "fidelity", "copies"), CASES,
                         ids=[f"{n}-{'+'.join(s)}-{f}" for n, s, f, _ in CASES])
def test_stamped_program_equals_the_built_one(name: str, sets: tuple[str, ...], fidelity: str,
                                              copies: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_scenario(SCENARIOS / f"{name}.yaml", list(sets))
    stamped, built, copied = both(s, fidelity, monkeypatch)
    assert (copied > 0) == copies
    assert len(stamped.tasks) == len(built.tasks)
    assert exact(stamped) == exact(built)


def small(**kw: Any) -> Any:
    par = {"tp": 2, "pp": 2, "dp": 1, **kw.pop("parallel", {})}
    world = par["tp"] * par["pp"] * par["dp"] * par.get("cp", 1)
    return scenario_from_dict({
        "name": "stamp", "model": kw.pop("model", GPT),
        "cluster": {"system": "dgx-a100-80gb", "nodes": max(world // 8, 1),
                    "gpus_per_node": min(world, 8)},
        "parallel": par, "training": {"global_batch": 6 * par["dp"], "micro_batch": 1},
        **kw})


@pytest.mark.parametrize("case", [
    {"parallel": {"cp": 2, "cp_comm_type": "p2p"}},
    {"parallel": {"cp": 2, "cp_comm_type": "allgather"}},
    {"parallel": {"dp": 2, "ep": 2}, "model": MOE},
    {"parallel": {"dp": 2, "ep": 2, "recompute": "full"}, "model": MOE},
    {"parallel": {"dp": 2, "zero": 3}},
], ids=["cp-ring", "cp-allgather", "moe", "moe-recompute", "zero3"])
def test_context_parallel_and_experts(case: dict[str, Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    s = small(**case)
    stamped, built, copied = both(s, "folded", monkeypatch)
    assert (copied > 0) == (s.parallel.zero != 3)
    assert exact(stamped) == exact(built)


def test_a_dependency_on_the_task_before_the_action_follows_the_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The context-parallel ring starts after the task before the attention block: in
    a copied action, the copy's own predecessor, not the recorded action's."""
    s = small(parallel={"cp": 2, "cp_comm_type": "p2p"})
    stamped, built, copied = both(s, "folded", monkeypatch)
    assert copied
    outside = [t for t in stamped.tasks if t.stream == "cp" and t.deps
               and stamped.tasks[t.deps[0]].microbatch != t.microbatch]
    assert outside  # the ring of a forward's first layer waits on the action before it
    assert exact(stamped) == exact(built)


def test_a_pass_that_is_not_declared_stampable_stops_stamping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from simulator.strategies.tensor.workload import TensorPass

    monkeypatch.setattr(TensorPass, "stamps", False)
    _, _, copied = both(small(), "folded", monkeypatch)
    assert copied == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]),
       schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved"]),
       sp=st.booleans(), recompute=st.sampled_from(["none", "selective", "full"]),
       m=st.integers(2, 6), zero=st.sampled_from([0, 1, 2]))
def test_any_small_layout(tp: int, pp: int, schedule: str, sp: bool, recompute: str, m: int,
                          zero: int) -> None:
    par: dict[str, Any] = {"tp": tp, "pp": pp, "dp": 2, "schedule": schedule,
                           "sequence_parallel": sp and tp > 1, "recompute": recompute,
                           "zero": zero}
    if schedule == "interleaved":
        if pp == 1 or m % pp:
            m = pp * 2 if pp > 1 else m
            par["schedule"] = "1f1b" if pp == 1 else schedule
        if par["schedule"] == "interleaved":
            par["virtual_stages"] = 2
    s = scenario_from_dict({
        "name": "stamp", "model": {**GPT, "layers": 8},
        "cluster": {"system": "dgx-a100-80gb", "nodes": max(tp * pp * 2 // 8, 1),
                    "gpus_per_node": min(tp * pp * 2, 8)},
        "parallel": par, "training": {"global_batch": 2 * m, "micro_batch": 1}})
    assert exact(build_workload(s, fidelity="folded")) == \
        exact(build_workload(s, fidelity="folded", stamp=False))
