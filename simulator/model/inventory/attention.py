"""The attention variants: the unfused core (scores, softmax, dropout, AV) or one
FlashAttention kernel, rotary embeddings, and the core under context parallelism
(a rank's queries against every chunk's keys and values).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.model.inventory import fp8
from simulator.model.inventory.ops import (
    CORE_OPS,
    FLASH_BWD_KERNELS,
    Op,
    Pass,
    Shape,
    dtype_bytes,
    flash_scale,
    kv_per_rank,
    mem,
)
from simulator.spec.model_spec import ModelSpec
from simulator.system.attention_kernels import AttentionCall


def attention_ops(x: Shape, pass_: Pass) -> list[Op]:
    """The attention core: one flash kernel, or the unfused sequence."""
    T, dt, S = x.tokens, x.dt, x.scores
    fwd_flops = 4.0 * x.b * x.spec.seq_len ** 2 * x.q  # QKᵀ and AV, the full square
    heads = x.spec.heads / x.tp
    if x.st.flash:
        call = AttentionCall(x.st.attention, x.spec.seq_len, x.spec.head_size)
        before, after = unpad_ops(x, pass_)
        if pass_ == "fwd":  # read q, k, v; write o; keep q, k, v and the fp32 log-sum-exp
            return [*before, Op("attn_core", "attention", fwd_flops,
                                dt * T * (2 * x.q + 2 * x.kv), fwd_flops, "attention_fwd", 1,
                                dt * T * (x.q + 2 * x.kv) + 4 * T * heads + own_output(x),
                                flash_scale(pass_), attn=call), *after]
        return [*before, Op("attn_core", "attention", 2 * fwd_flops,
                            dt * T * (4 * x.q + 4 * x.kv), 2 * fwd_flops, "attention_bwd",
                            FLASH_BWD_KERNELS[x.st.attention], 0.0, flash_scale(pass_),
                            attn=call), *after]
    fused_softmax = x.st.attention == "unfused_fused_softmax"
    dropout = x.st.attention_dropout > 0
    half = fwd_flops / 2
    if pass_ == "fwd":
        ops = [Op("attn_scores", "gemm", half, dt * (T * (x.q + x.kv) + S), half, "gemm_fwd",
                  1, dt * T * (x.q + x.kv)),
               mem("attn_softmax", (2 if fused_softmax else 4) * S, dt, "softmax",
                   1 if fused_softmax else 2, dt * S)]
        if dropout:  # read p, write p' and the 1-byte mask; keep both
            ops.append(Op("attn_dropout", "memory", 0.0, (2 * dt + 1) * S, 0.0, "elementwise",
                          1, (dt + 1) * S))
        ops.append(Op("attn_av", "gemm", half, dt * (S + T * (x.kv + x.q)), half, "gemm_fwd",
                      1, dt * T * x.kv))
        return ops
    # backward in forward order (the caller reverses): dQ, dK from dS; dS from dP; dP, dV
    ops = [Op("attn_scores", "gemm", fwd_flops, dt * (2 * S + 2 * T * (x.q + x.kv)), half,
              "gemm_dgrad", 2),
           mem("attn_softmax", 3 * S, dt, "softmax", 1 if fused_softmax else 2)]
    if dropout:
        ops.append(Op("attn_dropout", "memory", 0.0, (2 * dt + 1) * S, 0.0, "elementwise"))
    ops.append(Op("attn_av", "gemm", fwd_flops, dt * (2 * S + 2 * T * (x.q + x.kv)), half,
                  "gemm_dgrad", 2))
    return ops


#: the kernels flash-attn's ``bert_padding`` helpers wrap (its varlen interface)
UNPADDED = ("flash1", "flash2")

#: Kernels of one ``unpad_input`` (flash_attn/bert_padding.py): the mask's sum, ``nonzero``
#: (a count and a select), the lengths' max, its ``.item()`` copy to the host, the cumsum,
#: ``F.pad`` and the ``torch.gather`` into the packed copy
UNPAD_KERNELS = 8


def unpad_ops(x: Shape, pass_: Pass) -> tuple[list[Op], list[Op]]:
    """The ops before and after a flash-attn kernel called on packed tokens
    (``stack.flash_unpad``), in forward order. llm-foundry's ``flash_attn_fn``
    (llmfoundry/models/layers/attention.py) makes a mask of ones when none is given and
    packs Q, K and V with three ``unpad_input`` calls, then ``pad_input``s the output;
    ``IndexFirstAxis`` and ``IndexPutFirstAxis`` (flash_attn/bert_padding.py) give the
    bytes: forward, each gather reads and writes its tensor, the pad zeroes the padded
    output, reads the packed one and writes it back (``torch.zeros`` + ``output[indices]
    = values``); backward, each unpad's gradient is a zeroed buffer its packed gradient is
    scattered into (``scatter_``: zeros, read, write), the pad's a gather of the output
    gradient. The index tensors (``repeat`` makes a broadcast view) and the mask's few
    bytes a token are left out. Each ``unpad_input`` reads two values back to the host
    (flash-attn v2.4.2 bert_padding.py: ``torch.nonzero``, whose output size the host
    needs, and ``seqlens_in_batch.max().item()``), six a forward, so the host waits there for
    the GPU to finish what it had queued (the QKV projection) and issues the packing's
    kernels onto an idle GPU: the forward's op is ``synced``, its host and device time
    add. The backward's scatters and gather read nothing back."""
    if not x.st.flash_unpad or x.st.attention not in UNPADDED:
        return [], []
    packed, tokens = x.q + 2 * x.kv, x.tokens
    if pass_ == "fwd":  # + the mask of ones (torch.ones_like)
        unpad = mem("attn_unpad", 2 * tokens * packed, x.dt, "copy", 3 * UNPAD_KERNELS + 1)
        return ([replace(unpad, synced=True)],
                [mem("attn_pad", 3 * tokens * x.q, x.dt, "copy", 2)])
    return ([mem("attn_unpad", 3 * tokens * packed, x.dt, "copy", 6)],
            [mem("attn_pad", 2 * tokens * x.q, x.dt, "copy", 1)])


def qkv_split_ops(x: Shape, pass_: Pass) -> list[Op]:
    """The backward of splitting one QKV projection's output into q, k and v views
    (``stack.qkv_grad_cat``): the attention returns dQ, dK and dV as separate tensors
    (flash_attn_triton.py ``FlashAttnFunc.backward``: three ``torch.empty_like``; flash-attn's
    unpadded path: each ``unpad_input`` gradient its own zeroed buffer) and autograd's
    ``split_with_sizes_backward`` concatenates them into d(qkv) for the projection's dgrad
    (``at::cat``: one kernel reading the three and writing T·(q + 2kv) elements). The
    forward's split is views (llm-foundry's layers/attention.py: ``qkv.split`` at b2a43a1,
    ``qkv.chunk(3, dim=2)`` at 300cc5c), so nothing runs there."""
    if pass_ != "bwd_input" or not x.st.qkv_grad_cat or x.qkv_kernels != 1:
        return []
    return [mem("qkv_grad_cat", 2 * x.tokens * (x.q + 2 * x.kv), x.dt, "copy")]


def own_output(x: Shape) -> float:
    """Bytes of its 16-bit output a fused attention kernel keeps for its own backward
    apart from what the out-projection keeps: none where the two share the tensor (16-bit
    linears: the out-projection's input is the kernel's output, counted there once), the
    whole output under FP8 linears, which keep a 1-byte copy of their own beside it
    (Transformer Engine's ``FusedAttnFunc.forward`` saves ``(q, k, v, out_f16)``,
    transformer_engine/pytorch/attention/dot_product_attention/backends.py; flash-attn's
    ``FlashAttnFunc`` saves ``out_padded``), and none under DeepSeek-V3's caching, whose
    one E5M6 copy serves both backwards (its §3.3.3)."""
    if not fp8.active(x) or fp8.deepseek(x.st):
        return 0.0
    return x.dt * x.tokens * x.q


def rope_ops(x: Shape, pass_: Pass) -> list[Op]:
    """Rotary embedding on q and k: one fused kernel each, or the eager sequence
    (slice, neg, cat, two muls, add: ~6 passes over the tensor, 5 kernels)."""
    if x.spec.position != "rope" or pass_ == "bwd_weight":
        return []
    elements = x.tokens * (x.q + x.kv)
    if x.st.fused("rope"):
        return [mem("rope", 2 * elements, x.dt, "elementwise", 2)]
    return [mem("rope", 12 * elements, x.dt, "elementwise", 10)]


def attention_core(spec: ModelSpec, b: int, tp: int, dt: int, pass_: Pass, cp: int = 1,
                   kernel: str = "flash2", heads: int = 1) -> Op:
    """The flash attention core of ``spec.seq_len`` queries per sequence against ``cp``
    times as many keys (context parallelism: a rank's chunk of queries meets every
    chunk's keys and values, as ring attention and the KV all-gather do, one ``kernel``
    call per chunk, each priced at the chunk's length), for 1 / ``heads`` of the TP
    rank's heads (the all-to-all variants' head split). Causal: half the counted FLOPs
    execute (load-balanced chunks); the backward recomputes the scores
    (:func:`~simulator.model.inventory.ops.flash_scale`)."""
    tokens, q_width = b * spec.seq_len, spec.q_width / tp / heads
    kv_width = kv_per_rank(spec, tp) * spec.head_size / heads
    fwd_flops = 4.0 * b * spec.seq_len**2 * cp * q_width  # QKᵀ and AV, a/tp heads
    call = AttentionCall(kernel, spec.seq_len, spec.head_size)
    if pass_ == "fwd":  # read q, k, v; write o
        return Op("attn_core", "attention", fwd_flops,
                  dt * tokens * (2 * q_width + 2 * cp * kv_width), fwd_flops / cp,
                  "attention_fwd", cp, 0.0, flash_scale(pass_), attn=call)
    # read q, k, v, o, do; write dq, dk, dv
    return Op("attn_core", "attention", 2 * fwd_flops,
              dt * tokens * (4 * q_width + 4 * cp * kv_width), 2 * fwd_flops / cp,
              "attention_bwd", FLASH_BWD_KERNELS.get(kernel, 3) * cp, 0.0,
              flash_scale(pass_), attn=call)


def context_parallel_ops(ops: tuple[Op, ...], local: ModelSpec, b: int, tp: int, dtype: str,
                         pass_: Pass, cp: int, kv_gathered: bool = False,
                         kv_kept: bool = False, a2a: int = 1) -> tuple[Op, ...]:
    """Ops priced on a rank's ``local`` chunk (seq_len / cp tokens) with the attention core
    against the whole sequence's keys (:func:`attention_core`; context parallelism runs
    a fused attention kernel whatever the stack's attention, as Transformer Engine's CP
    requires). With ``kv_gathered`` (the all-gather variant) the gathered keys and
    values are put in sequence order before the core, and in backward their gradients
    back in chunk order after it: one read and one write of the gathered bytes each
    (Transformer Engine's ``AttnFuncWithCPAndKVAllGather``,
    ``get_seq_chunk_ids_for_reordering_before_attn`` and ``..._after_attn``); with
    ``kv_kept`` (the stack keeps the gathered, ordered keys and values for the backward)
    the backward reorders only the gradients. With ``a2a`` > 1 (the all-to-all
    variants) the core runs a2a chunks' queries, 1 / a2a of the heads, against the
    cp / a2a ring chunks' keys, and the exchanged tensors are copied around each
    all-to-all (:func:`cp_a2a_copy_bytes`)."""
    if cp == 1 or pass_ == "bwd_weight":
        return ops
    # the stack's fused kernel; an unfused stack's core runs FlashAttention-2
    kernel = next((op.attn.kernel for op in ops if op.attn is not None), "flash2")
    seen = local.model_copy(update={"seq_len": local.seq_len * a2a}) if a2a > 1 else local
    core = attention_core(seen, b, tp, dtype_bytes(dtype), pass_, cp // a2a, kernel, a2a)
    out: list[Op] = []
    for op in ops:
        if op.name in CORE_OPS:
            if core in out:
                continue  # an unfused core's other kernels: replaced by the one core
            if kv_gathered:
                copies = 1 if pass_ == "fwd" or kv_kept else 2
                out.append(Op("cp_reorder", "memory", 0.0,
                              copies * 2 * cp * cp_kv_bytes(local, b, tp, dtype), 0.0, "copy"))
            elif a2a > 1:  # four tensors (Q, K, V, O or their gradients), two copies each
                out.append(Op("cp_reorder", "memory", 0.0, cp_a2a_copy_bytes(local, b, tp, dtype),
                              0.0, "copy", 8))
            out.append(core)
        else:
            out.append(op)
    return tuple(out)


def cp_a2a_bytes(local: ModelSpec, b: int, tp: int, dtype: str) -> tuple[float, float]:
    """Bytes of one rank's query (and output) and of its key (and value) in one layer,
    each a tensor one all-to-all of the all-to-all variants exchanges: s/cp tokens of
    the TP rank's heads, which become all s tokens of 1/cp of the heads (Transformer
    Engine's ``flash_attn_a2a_communicate``, ``[b, s//cp, h, d] -> [b, s, h//cp, d]``),
    the same size either way."""
    q = b * local.seq_len * local.q_width / tp * dtype_bytes(dtype)
    return q, cp_kv_bytes(local, b, tp, dtype) / 2


def cp_a2a_copy_bytes(local: ModelSpec, b: int, tp: int, dtype: str) -> float:
    """HBM bytes of the copies around the all-to-alls of one pass: each of the four
    tensors (Q, K, V and O forward; dO, dQ, dK and dV backward) is made contiguous
    before it is sent (``movedim(...).contiguous()``, or the chunk reorder after the
    core) and reordered after it arrives (``index_select`` of the sequence chunks, or
    ``contiguous()``): two copies, each one read and one write."""
    q, kv = cp_a2a_bytes(local, b, tp, dtype)
    return 2 * 2 * (2 * q + 2 * kv)


def cp_kv_bytes(local: ModelSpec, b: int, tp: int, dtype: str) -> float:
    """Bytes of one rank's key and value chunk of one layer (its TP share of KV heads)."""
    return 2.0 * b * local.seq_len * kv_per_rank(local, tp) * local.head_size * dtype_bytes(dtype)
