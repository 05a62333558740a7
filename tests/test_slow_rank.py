"""``clustersim measure --slow-rank R --slowdown K``: a straggler on purpose.

- The hooks make every timed piece (forward, backward, optimizer step) take K times
  as long: with a fake clock, a piece of 1 s sleeps K − 1 s after it.
- The run's scenario carries the same straggler (``variability.slow_gpus``) and the
  simulator makes that rank slower; bad options are refused before launching.
- One tiny real DP 2 run with rank 1 slowed (a few seconds) sleeps only on rank 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration.measured.measure import make_config, run_measure
from calibration.measured.measure_scenario import scenario_dict
from simulator.analysis.accounting.vocabulary import COMPUTE_CATEGORIES
from simulator.api import simulate_scenario
from simulator.spec.load import scenario_from_dict

TINY = {"layers": 4, "hidden": 32, "heads": 2, "ffn_hidden": 64, "vocab": 64, "seq_len": 16}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_every_piece_takes_k_times_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from calibration.measured import slow_rank

    clock = FakeClock()
    monkeypatch.setattr(slow_rank.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(slow_rank.time, "sleep", clock.sleep)

    class Piece(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock.now += 1.0  # one second of forward compute
            return Tick.apply(self.lin(x))

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            clock.now += 2.0  # two seconds of backward compute
            return g

    model = torch.nn.Sequential(Piece(), Piece())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = slow_rank.slow_down([model], opt, 3.0)
    x = torch.ones(2, 4, requires_grad=True)
    out = model(x)
    # hooks on tensors, not full backward hooks, which wrap every call of a piece in
    # extra autograd functions (~4 ms a tiny-gpt step the straggler was not timed for)
    assert "BackwardHook" not in type(out.grad_fn).__name__
    out.sum().backward()
    opt.step()
    # two forwards of 1 s, two backwards of 2 s, one optimizer step of 0 s: K − 1 = 2×
    assert clock.slept[:2] == [2.0, 2.0]
    assert clock.slept[2:4] == [4.0, 4.0]
    assert slow.slept_s == pytest.approx(12.0) and slow.pieces == 5
    assert slow_rank.report(slow) == {"slowdown_slept_s": slow.slept_s,
                                      "slowdown_asked_s": slow.asked_s, "slowdown_pieces": 5}
    assert slow_rank.report(None) == {}

    # what a step slept is timed: time.sleep overshoots (0.1 s a call here), and a
    # counting step records it per call; the report gives the timed steps' median
    def late(seconds: float) -> None:
        clock.slept.append(seconds)
        clock.now += seconds + 0.1
    monkeypatch.setattr(slow_rank.time, "sleep", late)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
    counted = slow.counting(step)
    for _ in range(3):
        counted()
    assert slow.step_slept_s == pytest.approx([12.5] * 3)  # 5 pieces: 12 s asked + 0.5
    assert slow.asked_s == pytest.approx(12.0 * 4) and slow.slept_s == pytest.approx(12 + 37.5)
    assert slow_rank.report(slow, 2)["slowdown_step_slept_s"] == pytest.approx(12.5)
    # every piece's own time is counted, sleeps taken out: 1 + 1 + 2 + 2 + 0 s a step
    assert slow.step_piece_s == pytest.approx([6.0] * 3)
    assert slow_rank.report(slow, 2)["slowdown_step_piece_s"] == pytest.approx(6.0)
    assert "slowdown_awake_piece_s" not in slow_rank.report(slow, 2)


def test_awake_steps_time_the_pieces_without_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up calls of a counting step do not sleep and time the pieces; the report
    gives their median after the first (cold) call beside the timed steps', whose
    pieces run slower after each sleep (the wake-up cost compare adds)."""
    torch = pytest.importorskip("torch")
    from calibration.measured import slow_rank

    clock = FakeClock()
    monkeypatch.setattr(slow_rank.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(slow_rank.time, "sleep", clock.sleep)
    forward_s = iter([3.0, 3.0] + [1.0] * 4 + [1.5] * 4)  # cold, awake, after sleeps

    class Piece(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock.now += next(forward_s)
            return self.lin(x)

    model = torch.nn.Sequential(Piece(), Piece())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = slow_rank.slow_down([model], opt, 3.0)
    x = torch.ones(2, 4, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
    counted = slow.counting(step, awake=3)
    for _ in range(5):
        counted()
    assert slow.step_slept_s[:3] == [0.0, 0.0, 0.0]
    assert slow.step_slept_s[3:] == pytest.approx([6.0, 6.0])  # 2 × (1.5 + 1.5) forward
    assert slow.step_piece_s == pytest.approx([6.0, 2.0, 2.0, 3.0, 3.0])
    got = slow_rank.report(slow, 2)
    assert got["slowdown_awake_piece_s"] == pytest.approx(2.0)  # the cold call left out
    assert got["slowdown_step_piece_s"] == pytest.approx(3.0)
    assert got["slowdown_step_slept_s"] == pytest.approx(6.0)


def test_pieces_are_the_top_level_modules() -> None:
    pytest.importorskip("torch")
    from calibration.measured.gpt import GPT, GPTConfig
    from calibration.measured.slow_rank import pieces

    model = GPT(GPTConfig.from_dict(TINY))
    got = pieces(model)
    assert got[0] is model.embed and got[-1] is model.head and got[-2] is model.norm
    assert got[1:-2] == list(model.layers.values())


@pytest.mark.parametrize(("tp", "pp", "dp", "schedule"), [(1, 1, 2, "1f1b"), (1, 2, 1, "1f1b")])
def test_the_scenario_carries_the_straggler(tmp_path: Path, tp: int, pp: int, dp: int,
                                            schedule: str) -> None:
    slow = make_config(tp=tp, pp=pp, dp=dp, schedule=schedule, model=TINY, device="cpu",
                       out_dir=tmp_path, slow_rank=1, slowdown=2.0)
    base = make_config(tp=tp, pp=pp, dp=dp, schedule=schedule, model=TINY, device="cpu",
                       out_dir=tmp_path)
    data = scenario_dict(slow)
    assert data["variability"] == {"slow_gpus": [{"ranks": [1], "compute_slowdown": 2.0}]}
    assert str(data["name"]).endswith("-slow1x2") and "variability" not in scenario_dict(base)
    fast, _ = simulate_scenario(scenario_from_dict(scenario_dict(base)), "engine")
    slowed, _ = simulate_scenario(scenario_from_dict(data), "engine")
    assert slowed["step_time_s"] > 1.3 * fast["step_time_s"]


@pytest.mark.parametrize(("options", "needle"), [
    ({"slow_rank": 2}, "slow_rank=2: name a rank 0..1"),
    ({"slow_rank": -3, "slowdown": 2.0}, "slow_rank=-3"),
    ({"slow_rank": 0, "slowdown": 0.5}, "slowdown=0.5: must lie in [1, 100]"),
    ({"slow_rank": 0, "slowdown": 2.0, "experts": 4, "ep": 2}, "dense TP/PP/DP worker only"),
])
def test_bad_straggler_options_are_refused(tmp_path: Path, options: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        make_config(tp=1, pp=1, dp=2, model=TINY, device="cpu", out_dir=tmp_path, **options)


def test_a_real_dp2_run_slows_only_rank_1(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = run_measure(1, 1, 2, model=TINY, micro_batches=2, steps=2, warmup=1,
                         device="cpu", out_dir=str(tmp_path), slow_rank=1, slowdown=2.0,
                         timeout_s=300)
    by_rank = {r["rank"]: r for r in result["per_rank"]}
    assert "slowdown_slept_s" not in by_rank[0]
    assert by_rank[1]["slowdown_slept_s"] > 0 and by_rank[1]["slowdown_pieces"] > 0
    slept = by_rank[1]["slowdown_step_slept_s"]
    assert 0 < slept < by_rank[1]["slowdown_slept_s"]
    scenario = (tmp_path / "scenario.yaml").read_text()
    assert "compute_slowdown" in scenario
    assert json.loads((tmp_path / "measured.json").read_text())["dp"] == 2
    # compare simulates the straggler as it slept: the slowdown that adds, to rank 1's
    # compute simulated without it, exactly what it slept in a median timed step
    from calibration.measured.compare import compare
    from simulator.spec.load import load_scenario

    got = compare(tmp_path, "cpu-1thread")
    base, _ = simulate_scenario(load_scenario(tmp_path / "scenario.yaml", [
        "cluster.system=cpu-1thread", "variability.slow_gpus=[]"]), "engine", "full")
    compute = sum(base["time_breakdown_s"][1][c] for c in COMPUTE_CATEGORIES)
    # ... plus what its pieces took beyond their awake warm-up time (the wake-up cost)
    woke = by_rank[1]["slowdown_step_piece_s"] - by_rank[1]["slowdown_awake_piece_s"]
    assert got["slowdown_as_slept"] == {"rank": 1, "compute_slowdown": pytest.approx(
        1 + (slept + woke) / compute, rel=1e-5)}
    assert got["scenario"]["variability"]["slow_gpus"][0]["compute_slowdown"] \
        == pytest.approx(1 + (slept + woke) / compute, rel=1e-5)
    assert got["measured_step_pooled"] is False
    # a step pooled from several runs (the validation's repeats) stands for the run's own
    # median; the trace's compute is rescaled with it, the simulation is the same
    pooled = compare(tmp_path, "cpu-1thread", step_time_s=2 * result["step_time_s"])
    assert pooled["measured_step_pooled"] is True
    assert pooled["measured"]["step_time_s"] == pytest.approx(2 * result["step_time_s"])
    assert pooled["measured"]["compute_s"] == pytest.approx(2 * got["measured"]["compute_s"])
    assert pooled["simulated"] == got["simulated"]
    # a measured.json from before the field: the scenario's slowdown as it is
    data = json.loads((tmp_path / "measured.json").read_text())
    for r in data["per_rank"]:
        r.pop("slowdown_step_slept_s", None)
    (tmp_path / "measured.json").write_text(json.dumps(data))
    old = compare(tmp_path, "cpu-1thread")
    assert old["slowdown_as_slept"] is None
    assert old["scenario"]["variability"]["slow_gpus"][0]["compute_slowdown"] == 2.0
