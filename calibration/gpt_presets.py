"""Model-size presets of the measured-run GPT, importable without torch.

:mod:`calibration.gpt` re-exports them (``from calibration.gpt import
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

#: Named presets accepted by ``--model``.
PRESETS: dict[str, dict[str, int]] = {"tiny-gpt": TINY_GPT}

#: The size keys a model dict may have (the simulator's ``model:`` names).
MODEL_KEYS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")
