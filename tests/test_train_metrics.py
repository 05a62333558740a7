"""A trainer's metric updates on the logits after each micro-batch's backward
(``stack.train_metrics``).

Composer calls ``_eval_train_metrics`` after every micro-batch's ``loss.backward()``
(composer/trainer/trainer.py ``_train_microbatch``, v0.14.1 to v0.17.2): the micro-batch's
own logits go to each training metric's ``update`` under ``torch.no_grad`` and the run's
precision context. llm-foundry's MPT has two, LanguageCrossEntropy and LanguagePerplexity
(composer/metrics/nlp.py: each a ``torch.nn.CrossEntropyLoss(reduction='sum')``), so
the cross-entropy over the vocabulary runs twice more, forward only: under amp_bf16
(torch.autocast, where cross_entropy autocasts to fp32) a cast of the bf16 logits to an
fp32 copy (aten/src/ATen/native/SoftMax.cpp ``log_softmax``: only Half takes the fused
half-to-float path), an fp32 log_softmax and nll_loss, then the metric's count and its
states' two additions; eval_forward shifts the labels once first (three small kernels).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_published import DEV_SET

from simulator.api import simulate_scenario
from simulator.builder.workload import build_workload
from simulator.model import transformer as mdl
from simulator.model.inventory.loss import LABEL_SHIFT_KERNELS, METRIC_STATE_KERNELS
from simulator.spec.load import scenario_from_dict

VOCAB = 50368


def _scenario(stack: dict[str, Any], micro_batch: int = 4, seq_len: int = 512,
              dp: int = 8, pp: int = 1, global_batch: int | None = None,
              vocab: int = VOCAB, zero: int = 3) -> Any:
    return scenario_from_dict({
        "name": "t",
        "model": {"preset": "gpt3-175b", "layers": 4, "hidden": 768, "heads": 12,
                  "ffn_hidden": 3072, "seq_len": seq_len, "vocab": vocab,
                  "position": "learned"},
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": dp * pp},
        "parallel": {"dp": dp, "pp": pp, "zero": zero},
        "training": {"global_batch": global_batch or 2 * dp * micro_batch,
                     "micro_batch": micro_batch},
        "stack": stack})


def _metric_ops(s: Any) -> tuple[Any, ...]:
    return mdl.train_metric_ops(s.model, s.training.micro_batch, s.parallel.tp,
                                s.parallel.sequence_parallel, s.training.dtype, s.stack)


def test_two_fp32_cross_entropies_over_the_logits_after_a_label_shift() -> None:
    """Composer's stack under bf16: the labels' shift (three kernels over the int64
    labels' 3·T elements), then per metric an fp32 copy of the bf16 logits (2 + 4 bytes
    an element) and a log_softmax that reads and writes fp32 (4 + 4) with nll_loss and
    the metric's four bookkeeping kernels."""
    s = _scenario({"preset": "composer-fsdp1"})
    assert s.stack.train_metrics == 2
    tokens = 4 * 512
    elements = tokens * VOCAB
    ops = _metric_ops(s)
    assert [op.name for op in ops] == ["metric_labels", "metric_cast", "metric_update",
                                       "metric_cast", "metric_update"]
    shift, cast, update = ops[:3]
    assert (shift.bytes, shift.kernels) == (8 * 3 * tokens, LABEL_SHIFT_KERNELS)
    assert (cast.bytes, cast.kernels, cast.cls) == (6 * elements, 1, "copy")
    assert (update.bytes, update.cls) == (8 * elements, "cross_entropy")
    assert update.kernels == 2 + METRIC_STATE_KERNELS
    assert all(op.flops == 0 and op.saved == 0 and op.kind == "memory" for op in ops)


def test_under_fp8_the_metrics_run_in_the_logits_dtype() -> None:
    """Composer's amp_fp8 enters Transformer Engine's fp8_autocast alone (composer/core/
    precision.py): no torch.autocast, so no cast, and log_softmax reads and writes bf16."""
    s = _scenario({"preset": "composer-fsdp1", "fp8": "delayed"})
    ops = _metric_ops(s)
    assert [op.name for op in ops] == ["metric_labels", "metric_update", "metric_update"]
    assert ops[1].bytes == 4 * 4 * 512 * VOCAB


@pytest.mark.parametrize("preset", ["megatron-core", "torchtitan", "deepspeed",
                                    "pytorch-eager", "megatron-2021"])
def test_the_other_stacks_compute_no_training_metric(preset: str) -> None:
    """Megatron-LM, torchtitan and DeepSpeed log the loss the step computed anyway."""
    s = _scenario({"preset": preset})
    assert s.stack.train_metrics == 0 and _metric_ops(s) == ()
    assert not any(t.name.startswith("metrics") for t in build_workload(s).tasks)


def test_each_micro_batch_updates_after_its_backward() -> None:
    """One metrics task per micro-batch on the compute stream, after every task of that
    micro-batch's backward (the embedding's last, then FSDP1's kernels before its
    reduce-scatter, which its post-backward hook issues inside ``loss.backward()``) and
    before the next micro-batch's first task."""
    s = _scenario({"preset": "composer-fsdp1"}, global_batch=8 * 4 * 3)
    assert s.microbatches == 3
    compute = build_workload(s).programs[0].streams["compute"]
    names = [t.name for t in compute]
    metrics = [i for i, n in enumerate(names) if n.startswith("metrics")]
    assert [names[i] for i in metrics] == [f"metrics mb{m}" for m in range(3)]
    for i, m in zip(metrics, range(3), strict=True):
        assert compute[i].kind == "forward" and compute[i].duration > 0
        mine = [j for j, t in enumerate(compute) if t.microbatch == m and j != i]
        later = [j for j, t in enumerate(compute) if t.microbatch > m]
        assert max(mine) < i < min(later, default=len(compute))
        assert names.index(f"embed.bwd mb{m}") < i


def test_only_the_stage_with_the_output_layer_updates() -> None:
    """Under pipelining (a stack override: Composer runs none) the last stage computes
    the metrics after each backward, after the gradient's send; the others none."""
    s = _scenario({"preset": "composer-fsdp1", "pipeline_runtime": "megatron"}, dp=4, pp=2,
                  zero=1)
    w = build_workload(s, fidelity="full")
    for rank, program in w.programs.items():
        got = [t.name for t in program.streams["compute"] if t.name.startswith("metrics")]
        last = w.layout.coord(rank).pp == 1
        assert got == ([f"metrics mb{m}" for m in range(s.microbatches)] if last else [])


@pytest.mark.parametrize("method", ["analytic", "engine"])
def test_the_metrics_add_their_time_to_an_unsharded_single_gpu_step(method: str) -> None:
    """One GPU, no collectives: the step grows by micro-batches × the ops' time exactly,
    in the step breakdown's forward."""
    base = _scenario({"preset": "composer-fsdp1", "train_metrics": 0}, dp=1, zero=0,
                     global_batch=12)
    assert base.microbatches == 3
    with_metrics = base.model_copy(update={
        "stack": base.stack.model_copy(update={"train_metrics": 2})})
    from simulator.system.costs import CostModel
    cost = CostModel(with_metrics.hardware, "bf16", host_us=with_metrics.stack.host_us)
    per_mb = cost.ops_time(_metric_ops(with_metrics))
    a, b = (simulate_scenario(x, method)[0] for x in (base, with_metrics))
    assert b["step_time_s"] - a["step_time_s"] == pytest.approx(3 * per_mb, rel=1e-9)
    forward = [r["step_breakdown_s"]["forward"] for r in (a, b)]
    assert forward[1] - forward[0] == pytest.approx(3 * per_mb, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(metrics=st.integers(0, 3), micro_batch=st.integers(1, 8),
       vocab=st.sampled_from([32000, 50368, 128256]), fp8=st.booleans())
def test_metric_time_grows_with_the_count_and_the_logits(metrics: int, micro_batch: int,
                                                          vocab: int, fp8: bool) -> None:
    """Each metric adds the same ops; their bytes scale with tokens × vocabulary; an FP8
    stack's (no autocast) move 4 of the 14 bytes an element."""
    stack = {"preset": "composer-fsdp1", "train_metrics": metrics,
             **({"fp8": "delayed"} if fp8 else {})}
    s = _scenario(stack, micro_batch=micro_batch, vocab=vocab)
    ops = _metric_ops(s)
    if not metrics:
        assert ops == ()
        return
    elements = micro_batch * 512 * vocab
    assert sum(op.bytes for op in ops[1:]) == metrics * (4 if fp8 else 14) * elements
    one = _scenario({**stack, "train_metrics": 1}, micro_batch=micro_batch, vocab=vocab)
    assert len(ops) - 1 == metrics * (len(_metric_ops(one)) - 1)


def test_the_development_sets_rows_run_composers_two_metrics() -> None:
    """Every row of the development set maps to Composer's stack with its two metrics,
    and a 125M row (the vocabulary's share largest) is slower for them."""
    from simulator.published.mapping import scenario_data
    from simulator.published.rows import read_rows

    rows = read_rows(DEV_SET)
    assert {scenario_from_dict(scenario_data(r)).stack.train_metrics for r in rows} == {2}
    [row] = [r for r in rows if r.name == "llmfoundry_a100_80g_mpt125m_seq2048_8gpu_mbs32_ga2_v2"]
    s = scenario_from_dict(scenario_data(row))
    without = s.model_copy(update={"stack": s.stack.model_copy(update={"train_metrics": 0})})
    with_them, plain = (simulate_scenario(x, "analytic")[0]["step_time_s"] for x in (s, without))
    assert with_them > 1.05 * plain


# ---------------------------------------------------------------- memory


def _long(stack: dict[str, Any], **kw: Any) -> Any:
    """A long-sequence, fully recomputed run: few activations, large logits."""
    hidden = kw.get("hidden", 1024)
    return scenario_from_dict({
        "name": "t",
        "model": {"preset": "gpt3-175b", "layers": kw.get("layers", 4), "hidden": hidden,
                  "heads": hidden // 128, "ffn_hidden": 4 * hidden,
                  "seq_len": kw.get("seq_len", 16384), "vocab": VOCAB, "position": "learned"},
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8, "zero": 3, "recompute": kw.get("recompute", "full")},
        "training": {"global_batch": 16 * kw.get("micro_batch", 1),
                     "micro_batch": kw.get("micro_batch", 1)},
        "stack": stack})


def test_after_the_backward_the_metrics_hold_the_logits_and_two_fp32_copies() -> None:
    """With few activations the peak is the metrics' moment: the micro-batch's bf16
    logits (kept by the trainer's outputs), autocast's fp32 copy and log_softmax's fp32
    output at once, every FSDP gradient shard made, no unit gathered, no activations
    (one micro-batch in flight)."""
    from simulator.analysis.memory import stage_breakdown, states

    s = _long({"preset": "composer-fsdp1"})
    quiet = _long({"preset": "composer-fsdp1", "train_metrics": 0})
    m, before = stage_breakdown(s, 0), stage_breakdown(quiet, 0)
    elements = 16384 * VOCAB
    assert m.moment == "metrics" and before.moment == ""
    assert m.logits == (2 + 4 + 4) * elements
    assert (m.activations, m.comm_buffers) == (0.0, 0.0)
    assert m.gradients == states(s, 0)[1]
    assert (m.weights, m.optimizer, m.device) == (before.weights, before.optimizer,
                                                  before.device)
    assert m.total > before.total


def test_where_activations_dominate_the_backwards_peak_stands() -> None:
    """No recomputation, four 2K sequences a micro-batch of a 4096-wide model: the
    backward's start holds more than the metrics' moment, and the breakdown is the one
    without metrics."""
    from simulator.analysis.memory import stage_breakdown

    shape = {"recompute": "none", "micro_batch": 4, "layers": 16, "hidden": 4096,
             "seq_len": 2048}
    s = _long({"preset": "composer-fsdp1"}, **shape)
    quiet = _long({"preset": "composer-fsdp1", "train_metrics": 0}, **shape)
    assert stage_breakdown(s, 0) == stage_breakdown(quiet, 0)


def test_an_fp8_stacks_metrics_hold_no_fp32_copy() -> None:
    from simulator.model.memory import metric_tensors

    s = _long({"preset": "composer-fsdp1", "fp8": "delayed"})
    assert metric_tensors(s) == (2 + 2) * 16384 * VOCAB
    assert metric_tensors(_long({"preset": "megatron-core"})) == 0.0


def test_the_memory_timeline_rises_by_the_metrics_while_they_run() -> None:
    """On the replayed timeline each metrics span holds metric_tensors more than the
    moment before it, and the rank's peak is memory.py's metrics moment (the root unit's
    gradient freed: the compute stream waited for its reduce-scatter after the
    backward, tests/test_zero3_reduce_wait.py)."""
    from simulator.analysis.memory import stage_breakdown
    from simulator.analysis.memory_timeline import memory_timeline
    from simulator.engine.engine import simulate
    from simulator.model.memory import metric_tensors

    s = _long({"preset": "composer-fsdp1"})
    result = simulate(build_workload(s), s.hardware)
    [curve] = memory_timeline(s, result, max_points=10**6)[:1]
    points = curve["points"]
    spans = [(start, end) for tid, start, end in result.spans
             if result.workload.tasks[tid].name.startswith("metrics")
             and result.workload.tasks[tid].rank == curve["rank"]]
    assert len(spans) == s.microbatches
    for start, _ in spans:
        at = max(i for i, (t, _) in enumerate(points) if t <= start)
        assert points[at][1] - points[at - 1][1] == pytest.approx(metric_tensors(s))
    assert max(v for _, v in points) == pytest.approx(stage_breakdown(s, 0).total, rel=1e-9)
