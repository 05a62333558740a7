"""Golden programs: the builder's output for a handful of small scenarios, pinned.

Each case builds a workload and hashes, task by task, everything the engine
reads (id, rank, stream, op, kind, name, duration, bytes, dependencies, group,
group key, destination, micro-batch, layer, chunk, weight-gradient share, the
collective's plan, and every stream's order). A refactor of the builder must
leave these hashes unchanged; a deliberate change of the programs updates them
(``python tests/test_workload_golden.py`` prints the current ones).

Floats enter the hash with 12 significant digits, so a last-bit difference of a
platform's ``log10`` cannot fail the test while any change of a task can.
The cases cover every pass: TP (with sequence parallelism, full recomputation and
pipelined communication overlap), every schedule, DDP buckets, ZeRO-1/2/3 with and without
prefetch, ZeRO-Offload, a device that cannot overlap communication, and full
fidelity.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest

from simulator.builder.tasks import Workload
from simulator.builder.workload import build_workload
from simulator.spec.load import load_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
FIELDS = ("id", "rank", "stream", "op", "kind", "name", "duration", "nbytes", "deps", "group",
          "group_key", "dst", "microbatch", "layer", "chunk", "weight_s", "dependents")
CPU = ["cluster.system=cpu-1thread", "cluster.gpus_per_node=8"]

# (scenario file, --set overrides, fidelity) -> (hash, number of tasks)
GOLDEN: dict[tuple[str, tuple[str, ...], str], tuple[str, int]] = {
    ("gpt-10b-8xa100-40gb-zero0", ("training.global_batch=8",), "folded"):
        ("81fa3303da5ce7a5", 1825),
    ("gpt-10b-8xa100-40gb-zero3", ("training.global_batch=8",), "folded"):
        ("b52711387b8b80ba", 4490),
    ("llama2-7b-1gpu-offload", (), "folded"):
        ("d9d8fd43f8c52c7c", 232),
    ("interleaved-vs-1f1b-interleaved", ("training.global_batch=8",), "folded"):
        ("a3a7fdfae08d0954", 5644),
    ("interleaved-vs-1f1b-1f1b", ("training.global_batch=4", "parallel.sequence_parallel=true",
                                  "parallel.recompute=full"), "folded"):
        ("24396f1ad386df12", 3592),
    ("interleaved-vs-1f1b-1f1b", ("training.global_batch=4", "parallel.sequence_parallel=true",
                                  "parallel.recompute=full", "stack.tp_overlap=pipelined"),
     "folded"):
        ("5eaafe8d6a472408", 8392),
    ("zb-h1-vs-1f1b-zbh1", (), "folded"):
        ("ea6583e575050dda", 6248),
    ("llama2-7b-8gpu-pp4-gpipe", (), "full"):
        ("05aaeab61ee13276", 2282),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.schedule=zb-h1", "parallel.zero=3",
                                 "parallel.recompute=full"), "full"):
        ("897d911e21fbc124", 6220),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.zero=3", "parallel.reshard_after_forward=false",
                                 "parallel.overlap.zero3_prefetch=false"), "folded"):
        ("a1189ed6ed29a89d", 1558),
    ("llama2-7b-8gpu-pp4-1f1b", (*CPU, "parallel.zero=2", "parallel.zero_offload=true"),
     "folded"):
        ("70d8c6f58adfc4c9", 1648),
    ("llama2-7b-8gpu-pp4-1f1b", ("parallel.zero=1", "parallel.dp_bucket_MB=1000"), "full"):
        ("67e898daf6d1a663", 2260),
    ("llama2-7b-8gpu-ddp", ("parallel.dp_bucket_MB=1000",), "folded"):
        ("04b78a950543e5dd", 2125),
    ("llama2-7b-8gpu-zero2", (), "folded"):
        ("0bccd9633b13e9cd", 2642),
}


def _canon(x: Any) -> Any:
    if isinstance(x, float):
        return f"{x:.12g}"
    if isinstance(x, tuple | list):
        return tuple(_canon(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, *(_canon(getattr(x, f.name)) for f in dataclasses.fields(x)))
    return x


def digest(w: Workload) -> str:
    h = hashlib.sha256()
    for t in w.tasks:
        h.update(repr(_canon(tuple(getattr(t, f) for f in FIELDS))).encode())
        h.update(repr(_canon(t.plan)).encode())
    for rank, program in sorted(w.programs.items()):
        for stream, tasks in program.streams.items():
            h.update(repr((rank, stream, [t.id for t in tasks])).encode())
    h.update(repr((w.weight, w.fidelity, w.schedule)).encode())
    return h.hexdigest()[:16]


def build(name: str, sets: tuple[str, ...], fidelity: str) -> Workload:
    return build_workload(load_scenario(SCENARIOS / f"{name}.yaml", list(sets)),
                          fidelity=fidelity)


@pytest.mark.parametrize(("name", "sets", "fidelity"), list(GOLDEN),
                         ids=[f"{n}{'+' if s else ''}{'+'.join(s)}-{f}" for n, s, f in GOLDEN])
def test_programs_unchanged(name: str, sets: tuple[str, ...], fidelity: str) -> None:
    w = build(name, sets, fidelity)
    assert (digest(w), len(w.tasks)) == GOLDEN[name, sets, fidelity]


def test_digest_sees_a_changed_task() -> None:
    w = build("llama2-7b-1gpu-offload", (), "folded")
    before = digest(w)
    task = next(t for t in w.tasks if t.duration > 0)
    task.duration *= 1 + 1e-9
    assert digest(w) != before
    task.duration /= 1 + 1e-9
    assert digest(w) == before
    w.tasks[-1].deps.append(0)
    assert digest(w) != before


if __name__ == "__main__":
    for key in GOLDEN:
        built = build(*key)
        print(f"    {key}: ({digest(built)!r}, {len(built.tasks)}),")
