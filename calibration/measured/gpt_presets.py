"""Model-size presets of the measured-run GPT, importable without torch.

:mod:`calibration.measured.gpt` re-exports them (``from calibration.measured.gpt import
TINY_GPT``); they live here so that ``clustersim measure`` can validate its
arguments and write scenarios on a machine without torch.
"""

from __future__ import annotations

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

#: Named presets accepted by ``--model``.
PRESETS: dict[str, dict[str, int]] = {"tiny-gpt": TINY_GPT, "small-gpt": SMALL_GPT}

#: The size keys a model dict may have (the simulator's ``model:`` names).
MODEL_KEYS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")
