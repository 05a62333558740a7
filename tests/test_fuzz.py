"""Hostile and broken input through the CLI entry points: exit 0 or 2, one line per
problem, never a traceback, a hang or a runaway allocation.

Two parts. A corpus of the nastiest files (``tests/data/hostile/``: alias bomb,
20,000-deep nesting, UTF-16, binary, a truncated profile, ...) plus corrupted run
and measurement directories runs in a subprocess under an address-space limit,
each case under a deadline, and the subprocess's peak memory is checked. Then
hypothesis mutates the scenario schema (any field, any nasty value), ``--set``
values as raw YAML text, and the file's bytes, each through ``main`` in-process.
The quick part runs in CI; ``-m slow`` runs many more examples.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzz_cli import run_one
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from small_scenario import SMALL as BASE_TEXT

from simulator.cli.exit_codes import DOES_NOT_FIT

ROOT = Path(__file__).parents[1]
HOSTILE = ROOT / "tests" / "data" / "hostile"

BASE: dict[str, Any] = yaml.safe_load(BASE_TEXT)
MEMORY_LIMIT = 1 << 30  # the bound on one invocation's peak memory
ALIAS_BOMB_SET = ("parallel.tp=[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], "
                  "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], "
                  "&e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]]")
MEASURED = [
    "", '{"step_time_s": 0.1, "per_rank": [{"comp', "[1, 2]", '"text"',
    '{"step_time_s": "fast", "compute_s": 0.1}', '{"step_time_s": 0, "compute_s": 0.1}',
    '{"step_time_s": NaN, "compute_s": 0.1}', '{"step_time_s": -1.0, "compute_s": 0.1}',
    '{"step_time_s": 1e999, "compute_s": 0.1}', '{"step_time_s": 0.1}',
    '{"step_time_s": 0.1, "per_rank": []}', '{"step_time_s": 0.1, "per_rank": [{"compute_s": '
    'true}]}', '{"step_time_s": 0.1, "compute_s": 0.1, "state_bytes": ["x"]}',
    '{"step_time_s": true, "compute_s": 0.1}',
]


def assert_clean(case: dict[str, Any], allowed: tuple[Any, ...] = (0, 2, DOES_NOT_FIT)
                 ) -> None:
    """Exit 0, 2 or 3 (does not fit); with 2, every problem on one printable ``error:``
    line."""
    err = case["stderr"]
    assert case["rc"] in allowed, case
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    if case["rc"] == 2:
        assert errors, case
    for line in err.splitlines():
        assert line.isprintable(), line
    assert len(errors) <= 12, errors  # one per problem, not a dump


def corpus_cases(tmp: Path) -> list[list[str]]:
    out = str(tmp / "out")
    cases: list[list[str]] = []
    base = str(ROOT / "scenarios" / "llama2-7b-8gpu-ddp.yaml")
    for path in sorted(HOSTILE.glob("*.yaml")):
        if path.name.startswith("profile-"):
            cases.append(["run", base, "--no-plots", "--out", out, "--set",
                          f"cluster.system={path}"])
        else:
            cases.append(["validate", str(path)])
            cases.append(["run", str(path), "--no-plots", "--out", out])
    cases.append(["validate", base, "--set", ALIAS_BOMB_SET])
    cases.append(["validate", base, "--set", ".".join(["a"] * 5000) + "=1"])  # deep key path
    for text in ("parallel.zero=true", "model.vocab=true", 'training.global_batch="128"',
                 "training.global_batch=0x80", "training.global_batch=1_28",
                 "training.global_batch=128.0", "parallel.dp_bucket_MB=1e300",
                 "cluster.inter_node_bandwidth_GBps=1e-300", "model.layers=1000000000",
                 "training.global_batch=800000000"):
        cases.append(["run", base, "--no-plots", "--out", out, "--set", text])
    for i, text in enumerate(MEASURED):
        run_dir = tmp / f"measured{i}"
        run_dir.mkdir()
        (run_dir / "measured.json").write_text(text)
        (run_dir / "scenario.yaml").write_text(BASE_TEXT)
        cases.append(["compare", str(run_dir), "--profile", "dgx-a100-80gb", "--no-plot"])
    return cases + plot_cases(tmp)


def plot_cases(tmp: Path) -> list[list[str]]:
    """A good run directory, then copies of it with one file cut short or emptied."""
    scenario = tmp / "small.yaml"
    scenario.write_text(BASE_TEXT)
    good = tmp / "good"
    assert run_one(["run", str(scenario), "--no-plots", "--out", str(good)])["rc"] == 0
    cases = []
    for name in sorted(p.name for p in good.iterdir() if p.is_file()):
        data = (good / name).read_bytes()
        for cut, keep in (("half", len(data) // 2), ("empty", 0), ("line", data.find(b"\n"))):
            bad = tmp / f"plot-{name}-{cut}"
            shutil.copytree(good, bad)
            (bad / name).write_bytes(data[:keep])
            cases.append(["plot", str(bad)])
    return cases


def _expected(argv: list[str]) -> tuple[int, ...]:
    """Exit statuses a corpus case may give: 2, except for valid inputs."""
    if argv[0] == "validate" and Path(argv[1]).name in ("huge-batch.yaml", "huge-layers.yaml"):
        return (DOES_NOT_FIT,)  # valid scenarios that do not fit; running them is refused
    return (2,)


def _limit_memory() -> None:
    # address space, a guard against a runaway allocation; the check is on peak RSS
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _fuzz_cli(cases: list[list[str]], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``tests/fuzz_cli.py`` on ``cases`` in a child under the address-space limit."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
           "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(ROOT / "tests" / "fuzz_cli.py")],
                          input=json.dumps(cases), capture_output=True, text=True, env=env,
                          timeout=900, preexec_fn=_limit_memory, check=False, cwd=cwd)


def test_corpus_of_hostile_inputs(tmp_path: Path) -> None:
    cases = corpus_cases(tmp_path)
    proc = _fuzz_cli(cases, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *results, usage = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases)
    for case in results:
        assert_clean(case, allowed=_expected(case["argv"]))
        if case["rc"] == 2:
            line = next(ln for ln in case["stderr"].splitlines() if ln.startswith("error"))
            assert " = " in line or ": " in line, line  # names the field or file
    assert usage["maxrss_bytes"] < MEMORY_LIMIT


# ------------------------------------------------------------------ hypothesis

def _paths(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix]
    return [p for k, v in node.items() for p in _paths(v, f"{prefix}{k}.")]


FIELDS = [p.rstrip(".") for p in _paths(BASE)] + [
    "parallel.zero", "parallel.virtual_stages", "parallel.recompute", "parallel.dp_bucket_MB",
    "parallel.sequence_parallel", "parallel.overlap.dp", "parallel.fsdp_prefetch",
    "model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.vocab",
    "model.seq_len", "cluster.intra_node_bandwidth_GBps", "cluster.link_latency_us",
    "cluster.oversubscription", "simulation.fidelity", "simulation.seed", "description",
    "name", "training", "model", "unknown.key",
]
NASTY = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 10**9, 10**12, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, 1e-300, 0.5, 128.0, -0.0, 5e-324]),
    st.booleans(), st.none(),
    st.text(max_size=12),
    st.sampled_from(["../../x", "/abs/name", "a\x1bb", "0x80", "1_28", "gpipe", "zb-h1",
                     "interleaved", "full", "selective", "tiny-gpt", "dgx-h100"]),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.sampled_from(["tp", "pp", "x"]), st.integers(0, 9), max_size=2),
)
RAW_YAML = st.one_of(
    st.text(alphabet=st.sampled_from(list("[]{}&*!|>:-,'\"#%@` \t\n0123456789.eE+_xa")),
            max_size=40),
    st.sampled_from(["[&a [1,2], *a]", "&a [*a]", "!!binary AAAA", "!!python/name:os.system",
                     "!!float 1e400", "!!int 0x80", ".nan", "-.inf", "1e300", "{a: 1, a: 2}",
                     "[" * 40 + "]" * 40, "2026-01-01", "~", "yes", "'\\x00'"]),
)
QUICK = settings(max_examples=25, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])
SLOW = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(data))
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    return out


def _schema_mutation(tmp: Path, changes: list[tuple[str, Any]]) -> None:
    data = BASE
    for path, value in changes:
        data = _set(data, path, value)
    scenario = tmp / "fuzz.yaml"
    scenario.write_text(yaml.safe_dump(data, allow_unicode=False))
    case = run_one(["validate", str(scenario)])
    assert_clean(case)
    if case["rc"] == 0:
        for method in ("analytic", "engine"):
            assert_clean(run_one(["run", str(scenario), "--method", method, "--no-plots",
                                  "--max-tasks", "20000", "--out", str(tmp / "out")]))


def _raw_override(tmp: Path, field: str, raw: str) -> None:
    scenario = tmp / "base.yaml"
    scenario.write_text(BASE_TEXT)
    assert_clean(run_one(["validate", str(scenario), "--set", f"{field}={raw}"]))


def _mangled_file(tmp: Path, data: bytes) -> None:
    scenario = tmp / "mangled.yaml"
    scenario.write_bytes(data)
    assert_clean(run_one(["validate", str(scenario)]))


MUTATIONS = st.lists(st.tuples(st.sampled_from(FIELDS), NASTY), min_size=1, max_size=3)
MANGLED = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.integers(0, len(BASE_TEXT)), st.integers(0, 20), st.binary(max_size=8)).map(
        lambda t: BASE_TEXT.encode()[:t[0]] + t[2] + BASE_TEXT.encode()[t[0] + t[1]:]),
)


@QUICK
@given(changes=MUTATIONS)
def test_schema_mutations(tmp_path: Path, changes: list[tuple[str, Any]]) -> None:
    _schema_mutation(tmp_path, changes)


@QUICK
@given(field=st.sampled_from(FIELDS), raw=RAW_YAML)
def test_raw_yaml_overrides(tmp_path: Path, field: str, raw: str) -> None:
    _raw_override(tmp_path, field, raw)


@QUICK
@given(data=MANGLED)
def test_mangled_files(tmp_path: Path, data: bytes) -> None:
    _mangled_file(tmp_path, data)


@pytest.mark.slow
@SLOW
@given(changes=MUTATIONS)
def test_schema_mutations_long(tmp_path: Path, changes: list[tuple[str, Any]]) -> None:
    _schema_mutation(tmp_path, changes)


@pytest.mark.slow
@SLOW
@given(field=st.sampled_from(FIELDS), raw=RAW_YAML)
def test_raw_yaml_overrides_long(tmp_path: Path, field: str, raw: str) -> None:
    _raw_override(tmp_path, field, raw)


@pytest.mark.slow
@SLOW
@given(data=MANGLED)
def test_mangled_files_long(tmp_path: Path, data: bytes) -> None:
    _mangled_file(tmp_path, data)


def test_peak_memory_is_the_invocations_not_the_test_runners(tmp_path: Path) -> None:
    """The corpus's memory bound reads the child's own peak: under a fork (the
    ``preexec_fn``), Linux carries the parent's ``ru_maxrss`` across ``exec``, so the
    bound used to measure how big pytest had grown (1.1 GB late in a full run)."""
    ballast = bytearray(400 << 20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, not just reserved
    proc = _fuzz_cli([], tmp_path)
    del ballast
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout.splitlines()[-1])
    assert usage["maxrss_bytes"] < 200 << 20, usage


@pytest.mark.parametrize("override, rc, says", [
    # found by the fuzz above: an explicit null meant no GPU count (an assert fired)
    ("cluster.gpus_per_node=", 0, ""),
    # a home directory that does not exist, a name longer than the file system allows
    ("cluster.system=~0/profile.yaml", 2, "cannot look it up"),
    ("cluster.system=~nosuchuser", 2, "cannot look it up"),
    ("cluster.system=" + "a" * 300 + ".yaml", 2, "cannot look it up"),
])
def test_overrides_the_fuzz_found(tmp_path: Path, override: str, rc: int, says: str) -> None:
    scenario = tmp_path / "base.yaml"
    scenario.write_text(BASE_TEXT)
    case = run_one(["validate", str(scenario), "--set", override])
    assert_clean(case)
    assert case["rc"] == rc and says in case["stderr"], case
