"""Megatron-Core's precision-aware optimizer flags -> the stack's optimizer-state dtypes.

``--use-precision-aware-optimizer`` hands the optimizer step to Transformer Engine's
FusedAdam, which stores the state in the dtypes ``--main-grads-dtype`` (fp32, bf16),
``--main-params-dtype`` (fp32, fp16), ``--exp-avg-dtype`` and ``--exp-avg-sq-dtype`` (fp32,
fp16, bf16, fp8) name (megatron/training/arguments.py, the parser's choices). What
Megatron-LM refuses, this refuses too, with its reason:

- a dtype other than fp32 without the flag (megatron/core/optimizer/optimizer_config.py
  ``__post_init__``: "exp_avg_dtype can only be fp32 when not using precision-aware
  optimizer");
- the flag without ``--use-distributed-optimizer`` (megatron/core/optimizer/__init__.py:
  "--use-precision-aware-optimizer only supported with distributed optimizer"), or with an
  ``--optimizer`` other than adam (optimizer_config.py: "only supported with adam");
- ``--main-grads-dtype bf16`` with ``--accumulate-allreduce-grads-in-fp32`` (arguments.py:
  "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set").

With bf16 parameters and fp32 master weights that TE's FusedAdam owns (no FP8, or delayed
scaling: ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``; under another FP8 recipe
Megatron-Core keeps the fp32 master itself), ``OptimizerConfig.store_param_remainders``
(default True, no flag turns it off) keeps each master weight as its 16 low bits:
``stack.param_remainders``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.errors import Problem, UserError
from simulator.imports.common import Draft

if TYPE_CHECKING:
    from simulator.imports.megatron_rules import Parsed

FLAG = "--use-precision-aware-optimizer"
#: Each dtype flag -> (the stack field it sets, the dtypes Megatron-LM's parser allows)
DTYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "--main-grads-dtype": ("main_grads", ("fp32", "bf16")),
    "--main-params-dtype": ("main_params_dtype", ("fp32", "fp16")),
    "--exp-avg-dtype": ("exp_avg_dtype", ("fp32", "fp16", "bf16", "fp8")),
    "--exp-avg-sq-dtype": ("exp_avg_sq_dtype", ("fp32", "fp16", "bf16", "fp8")),
}


def _dtypes(a: Parsed) -> dict[str, str]:
    out: dict[str, str] = {}
    for flag, (_, choices) in DTYPES.items():
        value = a.text(flag, "fp32") or "fp32"
        if value not in choices:
            raise UserError([Problem(flag, value, f"Megatron-LM's parser takes "
                                     f"{', '.join(choices)}")])
        out[flag] = value
    return out


def optimizer_states(a: Parsed, d: Draft) -> None:
    """The four dtypes into the stack, as Megatron-LM validates them."""
    dtypes = _dtypes(a)
    if not a.given(FLAG):
        for flag, value in dtypes.items():
            if value != "fp32":
                raise UserError([Problem(flag, value, f"Megatron-LM asserts fp32 without "
                                         f"{FLAG} (optimizer_config.py); add {FLAG}")])
        return
    if (a.text("--optimizer", "adam") or "adam") != "adam":
        raise UserError([Problem(FLAG, f"with --optimizer {a.text('--optimizer')}",
                                 "Megatron-Core supports it only with adam "
                                 "(optimizer_config.py); drop one of them")])
    if not a.given("--use-distributed-optimizer"):
        raise UserError([Problem(FLAG, "without --use-distributed-optimizer", "Megatron-Core "
                                 "supports it only with the distributed optimizer "
                                 "(megatron/core/optimizer/__init__.py); add "
                                 "--use-distributed-optimizer")])
    for flag in ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        d.set(f"stack.{DTYPES[flag][0]}", dtypes[flag])
    _main_grads(a, d, dtypes["--main-grads-dtype"])
    bf16, recipe = d.get("training.dtype") == "bf16", d.get("stack.fp8", "none")
    if bf16 and dtypes["--main-params-dtype"] == "fp32" and recipe in ("none", "delayed"):
        d.set("stack.param_remainders", True)


def _main_grads(a: Parsed, d: Draft, value: str) -> None:
    if value == "fp32":
        return
    if d.get("training.dtype") != "bf16":
        d.note("--main-grads-dtype", value, "bf16 main grads of non-bf16 parameters have no "
               "stack field; simulated with the stack's main grads")
        return
    if a.given("--accumulate-allreduce-grads-in-fp32"):
        raise UserError([Problem("--main-grads-dtype", value, "Megatron-LM asserts fp32 with "
                                 "--bf16 --accumulate-allreduce-grads-in-fp32 (arguments.py); "
                                 "drop one of them")])
    # bf16 without fp32 main grads: Megatron leaves accumulate_allreduce_grads_in_fp32
    # False, so the gradient buffers, and their reduction, are bf16
    d.set("stack.main_grads", "param")
    d.set("stack.grad_reduce_dtype", "param")
