"""The CLI tells the whole truth: a layout that does not fit exits 3 (documented), a
sweep refuses an unknown grid key and says why each point is invalid, a batch given in
tokens is warned about, and differently overridden runs never share a directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from small_scenario import SMALL

from simulator.cli.exit_codes import DOES_NOT_FIT, EXIT_CODES, epilog, memory_verdict
from simulator.cli.main import main
from simulator.outputs.run_dir import run_out_dir
from simulator.spec.load import load_scenario
from simulator.spec.rules import MAX_PLAUSIBLE_TOKENS, batch_warning

ROOT = Path(__file__).parents[1]
# llama2-7b as plain DDP on one node: 13.5 GB weights + 13.5 GB grads + 80.9 GB Adam
# states (16 bytes a parameter) alone are above the 80 GB of an A100; ZeRO-1 over 8 GPUs
# divides the optimizer states by 8; ZeRO-3 shards the weights and grads too and fits
TOO_BIG = SMALL.replace("preset: tiny-gpt", "preset: llama2-7b").replace(
    "tp: 2, pp: 2, dp: 2", "tp: 1, pp: 1, dp: 8")


@pytest.fixture
def too_big(tmp_path: Path) -> Path:
    path = tmp_path / "big.yaml"
    path.write_text(TOO_BIG)
    return path


def test_the_docs_table_is_the_codes_table() -> None:
    page = (ROOT / "docs" / "cli-exit-codes.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", page, re.M))
    assert {int(k): v.replace("\\|", "|") for k, v in rows.items()} == EXIT_CODES
    assert all(f"  {code:>3}  " in epilog() for code in EXIT_CODES)


def test_verdict_is_the_worst_stage_against_its_own_capacity() -> None:
    rows = [{"stage": 0, "total": 70e9, "capacity": 80e9},
            {"stage": 1, "total": 45e9, "capacity": 40e9}]  # a smaller GPU on stage 1
    v = memory_verdict(rows)
    assert (v.fits, v.stage, v.peak, v.capacity) == (False, 1, 45e9, 40e9)
    assert memory_verdict(rows[:1]).fits


@pytest.mark.parametrize("command", ["validate", "memory"])
def test_does_not_fit_is_status_3(command: str, too_big: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, str(too_big)]) == DOES_NOT_FIT
    out, err = capsys.readouterr()
    peak = float(re.search(r"memory: peak ([\d.]+) GB \(stage 0\) of 80 GB per GPU: DOES NOT "
                           r"FIT", out)[1])
    assert peak > 16 * 6.74  # bf16 weights and grads, fp32 Adam: 16 bytes a parameter
    assert err.startswith(f"error: memory: peak {peak} GB") and "--allow-oom" in err
    assert main([command, str(too_big), "--allow-oom"]) == 0
    assert main([command, str(too_big), "--set", "parallel.zero=3"]) == 0
    assert ": fits" in capsys.readouterr().out


def test_run_that_does_not_fit_writes_everything_and_exits_3(
        too_big: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["run", str(too_big), "--method", "analytic", "--out", str(out)]) == 3
    results = json.loads((out / "results.json").read_text())
    assert results["fits_in_memory"] is False and (out / "manifest.json").is_file()
    err = capsys.readouterr().err
    assert "outputs written; exit status 3" in err
    assert main(["run", str(too_big), "--method", "analytic", "--out", str(out),
                 "--allow-oom"]) == 0


def test_help_lists_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["run", "--help"], ["validate", "--help"], ["memory", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "exit status:" in capsys.readouterr().out and "    3  " in epilog()


def test_sweep_refuses_an_unknown_grid_key_before_any_point(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    assert main(["sweep", str(path), "--grid", "parallel.tp=1,2", "--grid",
                 "training.global_bacth=8,16", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error: --grid = 'training.global_bacth'" in err
    assert "did you mean 'global_batch'?" in err and "sweeping" not in err


def test_sweep_prints_why_each_point_is_invalid(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    assert main(["sweep", str(path), "--grid", "parallel.tp=2,3", "--workers", "1",
                 "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "1 invalid point(s):" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  parallel.tp=3: "))
    assert "model.heads" in line and "not divisible by tp" in line


def test_a_batch_in_tokens_is_warned_with_the_fix(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_warning(MAX_PLAUSIBLE_TOKENS // 4096, 4096) == []
    [line] = batch_warning(4_194_304, 2048)
    assert "4,194,304 sequences × 2,048 tokens" in line and "use 2,048 sequences" in line
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    seq = load_scenario(path).model.seq_len
    batch = MAX_PLAUSIBLE_TOKENS // seq + 16  # just over 64 Mi tokens a step
    assert main(["validate", str(path), "--set", f"training.global_batch={batch}"]) == 0
    assert "counts sequences, not tokens" in capsys.readouterr().err
    assert main(["validate", str(path), "--set",
                 f"training.global_batch={batch - 32}"]) == 0
    assert "counts sequences" not in capsys.readouterr().err
    # a sweep warns before computing, once per distinct warning of its points
    assert main(["sweep", str(path), "--grid", f"training.global_batch={batch},{batch - 32}",
                 "--grid", "parallel.zero=0,1", "--workers", "1", "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert err.count("counts sequences") == 1
    assert err.index("counts sequences") < err.index("cache off: every point computed")


def test_overridden_runs_get_their_own_directory(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    a, b = ["parallel.zero=1"], ["parallel.zero=2"]
    assert run_out_dir("small") == Path("out/small")
    assert len({run_out_dir("small", a), run_out_dir("small", b), Path("out/small")}) == 3
    assert run_out_dir("small", a) == run_out_dir("small", list(a))
    for sets in (a, b, []):
        argv = ["run", str(path), "--method", "analytic", "--no-plots"]
        assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    for sets, zero in ((a, 1), (b, 2), ([], 0)):
        results = json.loads((run_out_dir("small", sets) / "results.json").read_text())
        assert results["scenario"]["parallel"]["zero"] == zero


def test_replacing_another_scenarios_run_says_what_differs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    argv = ["run", str(path), "--method", "analytic", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert main(argv) == 0  # the same scenario again: nothing to say
    assert "holds a run of a different scenario" not in capsys.readouterr().err
    assert main([*argv, "--set", "parallel.zero=2"]) == 0
    err = capsys.readouterr().err
    assert "holds a run of a different scenario (parallel.zero: 0 → 2)" in err
