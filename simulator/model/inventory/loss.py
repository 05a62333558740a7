"""The cross-entropy over the vocabulary: the loss's kernels as each stack runs them
(:func:`loss_op`), and the training metrics a trainer computes again from the same
logits after each micro-batch's backward (:func:`metric_ops`).
"""

from __future__ import annotations

from simulator.model.inventory.ops import Op, Pass, mem
from simulator.spec.stack import StackSpec

#: vocabulary-wide rows: the loss's cost class, on its own curve, not the softmax's
CROSS_ENTROPY = "cross_entropy"

#: Host-issued kernels of one Composer metric update beyond the cross-entropy's:
#: torchmetrics' ``LanguageCrossEntropy.update`` (composer/metrics/nlp.py, v0.14-v0.17)
#: counts ``(target != ignore_index).sum()`` (two kernels) and adds the loss and the
#: count to its states (two ``+=``)
METRIC_STATE_KERNELS = 4

#: Kernels of the labels' shift Composer's ``HuggingFaceModel.eval_forward``
#: (composer/models/huggingface.py, ``shift_labels``) runs once a micro-batch before the
#: metrics: ``labels[:, 1:].clone()``, its copy into ``labels[:, :-1]`` and the last
#: column's fill
LABEL_SHIFT_KERNELS = 3


def torch_cross_entropy(elements: float, wide: int, pass_: Pass) -> Op:
    """PyTorch's ``F.cross_entropy`` over ``elements`` logits of ``wide`` bytes
    (aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss``): forward log_softmax (the
    logits read, fp32 log-probabilities written) and nll_loss's gather; backward
    nll_loss's zero-filled gradient and its scatter, then log_softmax's backward (the
    gradient and the log-probabilities read, the logits' gradient written)."""
    fwd = pass_ == "fwd"
    return Op("loss", "memory", 0.0, elements * (wide + 4 if fwd else 4 + 8 + wide), 0.0,
              CROSS_ENTROPY, 2 if fwd else 3)


def loss_op(st: StackSpec, elements: float, wide: int, pass_: Pass) -> Op:
    """The cross-entropy over ``elements`` logits of ``wide`` bytes. Fused: one kernel
    each way, the logits read and an fp32 softmax written (or read back). Megatron's
    vocab-parallel form: about four fp32 passes in six kernels each way. PyTorch's
    (``torch``): :func:`torch_cross_entropy`. flash-attn's (``flash``): forward reads
    the logits and writes a loss and log-sum-exp per row; backward reads the logits again
    and writes their gradient, one kernel each way."""
    if st.loss == "flash":  # forward reads the logits; backward reads them, writes the grad
        return Op("loss", "memory", 0.0, elements * wide * (1 if pass_ == "fwd" else 2), 0.0,
                  CROSS_ENTROPY, 1)
    if st.fused("cross_entropy"):
        return Op("loss", "memory", 0.0, elements * (wide + 4), 0.0, CROSS_ENTROPY, 1)
    if st.loss == "torch":
        return torch_cross_entropy(elements, wide, pass_)
    return Op("loss", "memory", 0.0, elements * (wide + 16), 0.0, CROSS_ENTROPY, 6)


def metric_bytes(st: StackSpec, dt: int) -> int:
    """Bytes of an element of a training metric's cross-entropy over ``dt``-byte logits:
    fp32 under autocast's amp_bf16 (:func:`metric_ops`), the logits' own under an FP8
    stack (Composer's amp_fp8 enters no torch.autocast)."""
    return dt if st.fp8 != "none" else 4


def metric_ops(st: StackSpec, tokens: float, elements: float, dt: int) -> tuple[Op, ...]:
    """What a trainer runs on one micro-batch's ``elements`` logits of ``dt`` bytes (over
    ``tokens`` tokens) after its backward to update ``stack.train_metrics`` cross-entropy
    metrics. Composer's trainer calls ``_eval_train_metrics`` after every micro-batch's
    ``loss.backward()`` (composer/trainer/trainer.py ``_train_microbatch``, v0.14.1 to
    v0.17.2): under ``torch.no_grad`` and the run's precision context, the model's
    outputs of that micro-batch (``eval_forward(batch, outputs)`` returns the logits,
    no second forward) are fed to each training metric's ``update``; llm-foundry's MPT
    has two (LanguageCrossEntropy and LanguagePerplexity, each a
    ``torch.nn.CrossEntropyLoss(reduction='sum')``), so the loss over the vocabulary is
    computed twice more, forward only. Under amp_bf16 (``torch.autocast``)
    cross_entropy runs in fp32 (PyTorch's autocast op reference lists cross_entropy
    and log_softmax among the ops that autocast to float32): a bf16 input is cast to an
    fp32 copy first (aten/src/ATen/native/SoftMax.cpp ``log_softmax``: only a Half
    input takes the fused half-to-float path), then an fp32 log_softmax. Composer's
    amp_fp8 enters Transformer Engine's ``fp8_autocast`` alone (composer/core/
    precision.py ``get_precision_context``), so an FP8 stack's metrics run in the
    logits' dtype."""
    if not st.train_metrics:
        return ()
    wide = metric_bytes(st, dt)
    cast = (mem("metric_cast", elements, wide + dt, "copy"),) if wide != dt else ()
    # log_softmax reads and writes its dtype, nll_loss gathers a value a row
    update = Op("metric_update", "memory", 0.0, 2 * wide * elements, 0.0, CROSS_ENTROPY,
                2 + METRIC_STATE_KERNELS)
    shift = mem("metric_labels", 3 * tokens, 8, "copy", LABEL_SHIFT_KERNELS)
    return (shift, *(*cast, update) * st.train_metrics)
