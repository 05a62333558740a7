"""Model-size presets of the measured-run GPT, importable without torch.

:mod:`calibration.measured.gpt` re-exports them (``from calibration.measured.gpt import
TINY_GPT``); they live here so that ``clustersim measure`` can validate its
arguments and write scenarios on a machine without torch.
"""

from __future__ import annotations

from typing import Any

#: The ``tiny-gpt`` preset: small enough that a CPU step takes well under a second.
TINY_GPT: dict[str, int] = {
    "layers": 4,
    "hidden": 128,
    "heads": 4,
    "ffn_hidden": 512,
    "vocab": 512,
    "seq_len": 64,
}

#: ``small-gpt``: GEMMs large enough (~0.1-0.4 GFLOP each) that kernels, not the
#: framework's per-op overhead, dominate a CPU step (about a second per step).
SMALL_GPT: dict[str, int] = {
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "ffn_hidden": 2048,
    "vocab": 4096,
    "seq_len": 256,
}

#: ``tiny-llama``: tiny-gpt's sizes with Llama's block (:mod:`calibration.measured.llama`:
#: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases).
TINY_LLAMA: dict[str, Any] = {**TINY_GPT, "kv_heads": 2, "arch": "llama"}

#: ``llama-1b``: Llama 3.2 1B's sizes (meta-llama/Llama-3.2-1B config.json: 16 layers,
#: hidden_size 2048, 32 attention heads, 8 key-value heads, intermediate_size 8192,
#: vocab_size 128256, tie_word_embeddings true) at 2,048 tokens: 1.24B parameters.
LLAMA_1B: dict[str, Any] = {
    "layers": 16,
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 8,
    "ffn_hidden": 8192,
    "vocab": 128256,
    "seq_len": 2048,
    "arch": "llama",
}

#: Named presets accepted by ``--model``.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-gpt": TINY_GPT, "small-gpt": SMALL_GPT, "tiny-llama": TINY_LLAMA,
    "llama-1b": LLAMA_1B}

#: The size keys a model dict may have (the simulator's ``model:`` names).
MODEL_KEYS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")
#: Optional keys: grouped-query attention's key-value heads (default: heads) and the
#: block's architecture, ``gpt`` (GPT-2, the default) or ``llama``.
OPTIONAL_KEYS = ("kv_heads", "arch")
ARCHES = ("gpt", "llama")
