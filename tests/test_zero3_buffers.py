"""ZeRO-3's buffers by moment (simulator/strategies/zero3/buffers.py): the table's peak is
the larger of the loss's backward and the first block's, each with only what exists
then, not the sum of each buffer's largest.

The oracles are closed forms of parameter counts: a layer of the toy Llama below holds
q, k, v, o (h·h + 2·h·kv·d + h·h) and gate, up, down (3·h·f) plus two norms (2·h); the
root unit the embedding and the output layer (V·h each) and the final norm (h).
"""

from __future__ import annotations

from typing import Any

import pytest

from simulator.analysis.memory import memory_items, stage_breakdown
from simulator.model.inventory.sharding import zero3_blocks
from simulator.model.memory import logits
from simulator.spec.load import scenario_from_dict
from simulator.spec.scenario import Scenario
from simulator.strategies.zero3.buffers import zero3_moments, zero3_peak

H, F, HEADS, KV, V, SEQ, LAYERS = 256, 768, 4, 2, 8192, 256, 4
LAYER = H * H + 2 * H * KV * (H // HEADS) + H * H + 3 * H * F + 2 * H  # parameters
HEAD = V * H + H  # output layer and final norm
ROOT = V * H + HEAD  # embedding + head + final norm


def toy(vocab: int = V, stack: str = "torchtitan", **parallel: Any) -> Scenario:
    par = {"tp": 1, "pp": 1, "dp": 8, "zero": 3, "recompute": "none", **parallel}
    gpus = par["tp"] * par["pp"] * par["dp"]
    return scenario_from_dict({
        "name": "zero3-buffers",
        "model": {"layers": LAYERS, "hidden": H, "heads": HEADS, "kv_heads": KV,
                  "ffn_hidden": F, "vocab": vocab, "seq_len": SEQ, "activation": "swiglu",
                  "norm": "rmsnorm", "bias": False, "position": "rope",
                  "tied_embeddings": False},
        "cluster": {"system": "dgx-h100", "nodes": 1, "gpus_per_node": gpus},
        "parallel": par,
        "training": {"global_batch": 8 * par["dp"] // par["pp"] // 4 * 4, "micro_batch": 2,
                     "dtype": "bf16"},
        "stack": {"preset": stack},
    })


def test_loss_moment_holds_every_logits_copy_the_root_and_the_running_layer() -> None:
    """FSDPMemTracker's peak on Llama 3 8B: the loss's backward, with the root unit and
    the last block gathered, no gradient yet; the table held a prefetched block, a
    block's unsharded gradient and the output layer's gradient besides (the bug)."""
    s = toy()
    loss, block = zero3_moments(s, 0)
    elements = 2 * SEQ * V
    assert loss.buffers == pytest.approx(2 * (ROOT + LAYER), rel=1e-12)
    assert loss.logits == pytest.approx(4 * elements * 3, rel=1e-12)  # softmax + 2 grads
    assert block.buffers == pytest.approx(2 * (ROOT + HEAD + 3 * LAYER), rel=1e-12)
    assert block.logits == 0  # one micro-batch in flight: its loss freed
    assert zero3_peak(s, 0) == loss
    br = stage_breakdown(s, 0)
    assert (br.comm_buffers, br.logits) == (loss.buffers, loss.logits)


def test_block_moment_where_the_logits_are_small() -> None:
    """A small vocabulary: the first block's backward (running and prefetched blocks, its
    unsharded gradient, the output layer's gradient) outweighs the loss's copies; the
    table then holds no logits."""
    s = toy(vocab=128)
    root, head = 128 * H * 2 + H, 128 * H + H
    loss, block = zero3_moments(s, 0)
    assert block.buffers == pytest.approx(2 * (root + head + 3 * LAYER), rel=1e-12)
    br = stage_breakdown(s, 0)
    assert zero3_peak(s, 0).name == "block"
    assert (br.comm_buffers, br.logits) == (block.buffers, 0.0)
    assert block.total > loss.total


def test_the_peak_is_the_larger_moment_not_the_sum() -> None:
    for s in (toy(), toy(vocab=128), toy(fsdp_prefetch=2), toy(reshard_after_forward=False)):
        br = stage_breakdown(s, 0)
        loss, block = zero3_moments(s, 0)
        assert br.comm_buffers + br.logits == max(loss.total, block.total)
        assert br.comm_buffers + br.logits < block.buffers + logits(s, 0)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_adds_to_the_block_moment_only(prefetch: int) -> None:
    loss, block = zero3_moments(toy(fsdp_prefetch=prefetch), 0)
    assert loss.buffers == pytest.approx(2 * (ROOT + LAYER), rel=1e-12)
    assert block.buffers == pytest.approx(2 * (ROOT + HEAD + (2 + prefetch) * LAYER),
                                          rel=1e-12)


def test_without_reshard_every_layer_stays_gathered_at_both_moments() -> None:
    loss, block = zero3_moments(toy(reshard_after_forward=False), 0)
    assert loss.buffers == pytest.approx(2 * (ROOT + LAYERS * LAYER), rel=1e-12)
    assert block.buffers == pytest.approx(2 * (ROOT + HEAD + (LAYERS + 1) * LAYER), rel=1e-12)


def test_gpipe_keeps_the_other_micro_batches_softmax_at_the_block_moment() -> None:
    """GPipe's last stage holds every micro-batch's softmax at its first backward; the
    first block's backward runs after one loss's backward: m − 1 remain, no gradient."""
    s = toy(vocab=128, pp=2, dp=4, schedule="gpipe")
    m, last = s.microbatches, 1
    assert m > 1
    elements = 2 * SEQ * 128
    loss, block = zero3_moments(s, last)
    assert loss.logits == pytest.approx(4 * elements * (m + 2), rel=1e-12)
    assert block.logits == pytest.approx(4 * elements * (m - 1), rel=1e-12)


def test_a_stage_without_the_head_peaks_at_its_block_moment() -> None:
    """No loss, no output layer: the block's moment holds the loss's and more, as before.
    torchtitan pipelines with torch.distributed.pipelining, which defers FSDP2's
    reductions (strategies.zero3.deferred): the stage's two layers stay gathered, and
    with two micro-batches its units' gradients (two layers and the embedding) are held
    unsharded in fp32 by the second backward."""
    s = toy(pp=2, dp=4)
    assert s.microbatches == 2
    loss, block = zero3_moments(s, 0)
    embedding = V * H
    assert loss.logits == block.logits == 0
    accumulated = 4 * (2 * LAYER + embedding)
    assert block.buffers == pytest.approx(2 * (embedding + 3 * LAYER) + accumulated,
                                          rel=1e-12)
    assert stage_breakdown(s, 0).comm_buffers == block.buffers


@pytest.mark.parametrize("stack", ["composer-fsdp1", "deepspeed"])
def test_fsdp1_and_deepspeed_units_take_the_larger_moment(stack: str) -> None:
    """FSDP1's flat parameters gather by layers as FSDP2 does; DeepSpeed's module units by
    attention and MLP blocks: at the loss the larger single block, at the first block's
    backward 1 + fsdp_prefetch consecutive blocks (one layer at the default prefetch)."""
    s = toy(stack=stack)
    loss, block = zero3_moments(s, 0)
    br = stage_breakdown(s, 0)
    assert br.comm_buffers + br.logits == max(loss.total, block.total)
    if s.stack.zero3_unit == "module":
        blocks = zero3_blocks(s.model, s.stack, 1, 1.0)  # in layers
        attn, mlp = sum(blocks["attn"]) * LAYER, sum(blocks["mlp"]) * LAYER
        running = max(attn, mlp)
        assert loss.buffers == pytest.approx(2 * (ROOT + running), rel=1e-12)
        assert block.buffers == pytest.approx(2 * (ROOT + HEAD + attn + mlp + LAYER),
                                              rel=1e-12)
    else:
        assert s.stack.fsdp_flat_param
        assert loss.buffers == pytest.approx(2 * (ROOT + LAYER), rel=1e-12)


def test_the_memory_table_names_the_moment() -> None:
    for s, words in ((toy(), "the loss's backward"), (toy(vocab=128), "the first block's")):
        items = {name: source for name, _, source in memory_items(stage_breakdown(s, 0), s)}
        assert words in items["buffers"]
