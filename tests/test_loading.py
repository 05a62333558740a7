"""The loading layer: hostile bytes and YAML become one-line errors, never tracebacks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from simulator.errors import UserError
from simulator.loading import (
    MAX_DEPTH,
    MAX_NODES,
    TooLargeError,
    parse_override,
    parse_yaml,
    read_json,
    read_yaml,
)
from simulator.spec.load import load_scenario
from simulator.system.profiles import load_system, preset_system_names, validate_profile

HOSTILE = Path(__file__).parent / "data" / "hostile"
SCENARIO = Path(__file__).parents[1] / "scenarios" / "llama2-7b-8gpu-ddp.yaml"


def one_line(exc: pytest.ExceptionInfo[UserError]) -> str:
    (line,) = exc.value.lines()
    assert "\n" not in line and line.isprintable()
    return line


def problem(text: str) -> str:
    with pytest.raises(UserError) as exc:
        parse_yaml(text, "scenario", "f.yaml")
    return one_line(exc)


@pytest.mark.parametrize(("text", "value"), [
    ("a: 128", 128), ("a: -3", -3), ("a: 0", 0), ("a: 1e9", 1e9), ("a: 2.5e-3", 2.5e-3),
    ("a: 1.0e+8", 1e8), ("a: .5", 0.5), ("a: true", True), ("a: False", False),
    ("a: 0x80", "0x80"), ("a: 1_28", "1_28"), ("a: 0o17", "0o17"), ("a: 017", "017"),
    ("a: yes", "yes"), ("a: on", "on"), ("a: 1:30", "1:30"), ("a: null", None),
])
def test_scalars_follow_the_yaml_1_2_core_schema(text: str, value: object) -> None:
    assert parse_yaml(text, "scenario", "f.yaml") == {"a": value}


def test_non_finite_floats_are_read_for_the_schema_to_refuse() -> None:
    data = parse_yaml("a: .inf\nb: -.inf\nc: .nan", "scenario", "f.yaml")
    assert data["a"] == math.inf and data["b"] == -math.inf and math.isnan(data["c"])


def test_duplicate_keys_are_errors() -> None:
    line = problem("a: 1\nb: 2\na: 3\n")
    assert "duplicate key 'a'" in line and "line 3" in line


def test_merge_keys_still_work() -> None:
    assert parse_yaml("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n", "s", "f") == {
        "base": {"x": 1, "y": 2}, "c": {"x": 1, "y": 3}}


def test_deep_nesting_is_refused_before_python_recursion() -> None:
    for text in ("[" * 20_000 + "]" * 20_000, "- " * 20_000 + "x", "{a: " * 5_000):
        line = problem(text)
        assert f"deeper than {MAX_DEPTH}" in line


def test_nesting_just_within_the_bound_loads() -> None:
    text = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    data = parse_yaml(text, "s", "f")
    for _ in range(MAX_DEPTH - 2):
        (data,) = data
    assert data == []


def test_alias_bomb_is_refused_by_expanded_size() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(TooLargeError) as exc:
        parse_yaml("\n".join(lines), "scenario", "f.yaml")
    assert f"more than {MAX_NODES:,} values" in one_line(exc)


def test_aliases_nest_deeper_than_their_text() -> None:
    chain = ["a0: &a0 [[[[[[[[1]]]]]]]]"]
    chain += [f"a{i}: &a{i} [[[[[[[[*a{i - 1}]]]]]]]]" for i in range(1, 6)]
    assert "aliases are expanded" in problem("\n".join(chain))


def test_recursive_alias_is_refused() -> None:
    assert "recursive" in problem("a: &a [1, *a]")


def test_wide_documents_are_refused_while_composing() -> None:
    assert f"more than {MAX_NODES:,} values" in problem("a: [" + "1, " * 50_000 + "]")


def test_huge_integer_literal() -> None:
    assert "invalid YAML value" in problem("a: " + "9" * 5000)


@pytest.mark.parametrize(("raw", "words"), [
    (b"\xff\xfea\x00:\x00", "UTF-16"),
    ("name: x\n".encode("utf-16-be"), "binary"),  # no BOM: NUL bytes
    (b"name: caf\xe9\n", "not valid UTF-8 (byte 0xe9 at offset 9)"),
    (bytes(range(256)), "binary"),
])
def test_decoding_errors(tmp_path: Path, raw: bytes, words: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(raw)
    with pytest.raises(UserError) as exc:
        read_yaml(path, "scenario")
    assert words in one_line(exc)


def test_utf8_bom_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert read_yaml(path, "scenario") == {"a": 1}


def test_not_a_file_and_oversized(tmp_path: Path) -> None:
    with pytest.raises(UserError) as exc:
        read_yaml(tmp_path, "scenario")
    assert "is a directory" in one_line(exc)
    big = tmp_path / "big.yaml"
    big.write_text("#" * (1 << 20))
    with pytest.raises(UserError) as exc:
        read_yaml(big, "scenario")
    assert "is larger than" in one_line(exc)
    with pytest.raises(UserError) as exc:
        read_yaml(Path("/dev/zero"), "scenario")
    assert "is a special file" in one_line(exc)
    with pytest.raises(UserError) as exc:
        read_yaml(tmp_path / "missing.yaml", "scenario")
    assert "cannot read it" in one_line(exc)


def test_override_values_share_the_bounds() -> None:
    assert parse_override("[1, 2]", "--set x") == [1, 2]
    assert parse_override("a: b: c", "--set x") == "a: b: c"  # not YAML: the text itself
    with pytest.raises(TooLargeError):
        parse_override("[" * 100 + "]" * 100, "--set x")
    bomb = "[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], " \
           "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b], [*c,*c,*c,*c,*c,*c,*c,*c,*c]]"
    with pytest.raises(TooLargeError):
        parse_override(bomb, "--set x")


@pytest.mark.parametrize(("text", "words"), [
    ("", "is empty"), ('{"step_time_s": 1', "not valid JSON"), ("NaN", "not valid JSON"),
    ('{"a": Infinity}', "not valid JSON"), ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
])
def test_json_errors(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "measured.json"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        read_json(path, "run_dir")
    assert words in one_line(exc)
    path.write_text(json.dumps({"a": [1.5, None]}))
    assert read_json(path, "run_dir") == {"a": [1.5, None]}


# ------------------------------------------------------------------ profiles

def test_bundled_profiles_state_every_field() -> None:
    for name in preset_system_names():
        load_system(name)
    load_system(str(Path(__file__).parents[1] / "calibration/profiles/cpu-epyc-1thread.yaml"))


def _preset_data() -> dict:
    path = Path(__file__).parents[1] / "simulator/presets/systems/dgx-a100-80gb.yaml"
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize(("path", "value", "words"), [
    (("gpu", "peak_tflops", "bf16"), math.inf, "finite"),
    (("gpu", "peak_tflops", "bf16"), math.nan, "finite"),
    (("gpu", "peak_tflops", "bf16"), 0, "greater than or equal"),
    (("gpu", "peak_tflops", "bf16"), -312, "greater than or equal"),
    (("gpu", "hbm_bandwidth_GBps"), 1e300, "less than or equal"),
    (("intra_node", "bandwidth_GBps"), 1e-300, "greater than or equal"),
    (("intra_node", "latency_us"), True, "valid number"),
    (("gpus_per_node",), "8", "valid integer"),
    (("gpus_per_node",), 8.0, "valid integer"),
    (("gpu", "gemm_efficiency", "points"), [[1e5, 1e-300]], "efficiencies"),
])
def test_profile_ranges_and_types(path: tuple[str, ...], value: object, words: str) -> None:
    data = _preset_data()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(UserError) as exc:
        validate_profile(data, "p.yaml")
    line = one_line(exc)
    assert ".".join(path) in line and words in line


def test_truncated_profiles_are_refused() -> None:
    text = (Path(__file__).parents[1] / "calibration/profiles/cpu-epyc-1thread.yaml").read_text()
    lines = text.splitlines(keepends=True)
    end = next(i for i, ln in enumerate(lines) if ln.startswith("provenance:"))
    refused = 0
    for cut in range(3, end):  # every line boundary before the provenance
        data = yaml.safe_load("".join(lines[:cut]))
        with pytest.raises(UserError):
            validate_profile(data, "p.yaml")
        refused += 1
    assert refused == end - 3


def test_profile_through_a_scenario_names_the_field(tmp_path: Path) -> None:
    data = _preset_data()
    data["gpu"]["peak_tflops"]["bf16"] = 0
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError) as exc:
        load_scenario(SCENARIO, [f"cluster.system={prof}"]).hardware  # noqa: B018
    line = one_line(exc)
    assert line.startswith("cluster.system = ") and "gpu.peak_tflops.bf16 = 0" in line
