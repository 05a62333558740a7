"""Which forward collectives a recomputed layer issues again before its backward: those
inside the function its framework checkpoints, with the forward's bytes, on the
forward's streams (the engine's pipeline pass calls the passes' ``recompute_block`` hook
around each recomputed block; the analytic estimate counts them per layer).

Megatron-LM (commit d98e8a64 of 2026-08-22; :mod:`simulator.model.inventory.recompute_policy`
has where each module is applied):

* ``full``: ``checkpointed_forward`` (``megatron/core/recompute.py``; before,
  ``TransformerBlock._checkpointed_forward`` in ``transformer/transformer_block.py``)
  re-runs whole layers: both blocks' TP collectives, the attention's context-parallel
  exchange, a MoE layer's dispatch and combine. torchtitan's ``FullAC`` likewise.
* ``core_attn``: ``Attention._checkpointed_attention_forward``
  (``transformer/attention.py``) checkpoints ``_run_core_attention``, Transformer
  Engine's ``DotProductAttention``, inside which context parallelism exchanges
  (``TEDotProductAttention`` hands it ``cp_group`` and ``cp_comm_type``,
  ``extensions/transformer_engine.py``; TE's ``attn_forward_func_with_cp``): the ring,
  the key/value all-gather or the all-to-alls again; no TP collective (they are in the
  linears around the core).
* ``mlp``: ``TransformerLayer`` checkpoints ``self.mlp`` (``transformer_layer.py``,
  ``tensor_parallel.checkpoint``, ``te_checkpoint`` under FP8) whose ``linear_fc1``
  all-gathers its input under sequence parallelism
  (``LinearWithGradAccumulationAndAsyncCommunication.forward``,
  ``tensor_parallel/layers.py``) and whose ``linear_fc2`` reduce-scatters (all-reduces
  without SP) its output (``RowParallelLinear.forward``): the MLP block's TP
  collectives again.
* ``moe``: ``MoELayer.forward`` (``moe/moe_layer.py``) checkpoints ``custom_forward``:
  shared experts, router, ``dispatch``, routed experts, ``combine``: the dispatcher's
  exchanges (all-to-alls, expert-TP all-gather and reduce-scatter, or DeepEP's) and the
  MoE block's TP collectives again.
* ``layernorm``, ``moe_act``: ``CheckpointWithoutOutput`` over a norm or the experts'
  activation, which hold no collective.
* ``shared_experts``: ``SharedExpertMLP`` under ``tensor_parallel.checkpoint``; the
  model gives the shared experts no TP collective of their own (the MoE block's stand for
  them), so none again.
* ``mla_up_proj``: ``qkv_up_checkpoint`` (``multi_latent_attention.py``) holds the
  up-projections, whose column-parallel linears all-gather the latents under sequence
  parallelism; the model issues the attention block's all-gather of the layer input
  instead, before the down-projections, so none again (the latents' gathers are not
  modelled, in the forward either).

torchtitan's per-op policy (``recompute: op``; ``SelectiveAC``,
``torchtitan/distributed/activation_checkpoint.py`` at commit b5bcd76c of 2026-08-21):
``_get_default_save_ops`` saves the outputs of ``_c10d_functional.reduce_scatter_tensor``
and ``all_to_all_single`` ("to avoid re-communication") but not of
``all_gather_into_tensor`` nor ``all_reduce``, and the block's checkpoint
(``early_stop=False``) re-runs the whole forward but the saved ops: under sequence
parallelism the two all-gathers (the attention's and the MLP's input) run again and the
two reduce-scatters do not; without it the two row-wise outputs' all-reduces run again.
The attention kernel's output is saved, so no context-parallel exchange runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from simulator.spec.recompute import Policy, modules_of

BLOCKS = ("attn", "mlp")


@dataclass(frozen=True)
class Reissue:
    """What one recomputed layer issues again. ``blocks``: blocks re-run whole with every
    collective the forward issues around them (TP before and after; a MoE layer's MLP
    block its dispatch and combine too); ``gathers``: blocks whose sequence-parallel
    all-gather alone runs again; ``reduces``: blocks whose output all-reduce alone runs
    again (no SP); ``cp``: the attention core's context-parallel exchange."""

    blocks: tuple[str, ...] = ()
    gathers: tuple[str, ...] = ()
    reduces: tuple[str, ...] = ()
    cp: bool = False

    def __or__(self, other: Reissue) -> Reissue:
        def both(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(label for label in BLOCKS if label in a or label in b)
        return Reissue(both(self.blocks, other.blocks), both(self.gathers, other.gathers),
                       both(self.reduces, other.reduces), self.cp or other.cp)

    def touches(self, label: str) -> bool:
        """Whether block ``label`` issues anything again."""
        return label in self.blocks or label in self.gathers or label in self.reduces \
            or (label == "attn" and self.cp)


NOTHING = Reissue()
FULL = Reissue(blocks=BLOCKS, cp=True)

#: each Megatron module's collectives again, by whether the layer is a MoE layer
MODULE_REISSUE: dict[str, Callable[[bool], Reissue]] = {
    "core_attn": lambda moe: Reissue(cp=True),
    "mlp": lambda moe: NOTHING if moe else Reissue(blocks=("mlp",)),
    "moe": lambda moe: Reissue(blocks=("mlp",)) if moe else NOTHING,
    "layernorm": lambda moe: NOTHING,
    "moe_act": lambda moe: NOTHING,
    "shared_experts": lambda moe: NOTHING,
    "mla_up_proj": lambda moe: NOTHING,
}


@lru_cache(maxsize=256)
def reissued(policy: Policy, moe_layer: bool, sp: bool) -> Reissue:
    """The collectives a layer recomputed under ``policy`` issues again (``moe_layer``:
    it has routed experts; ``sp``: sequence parallelism)."""
    if policy == "none":
        return NOTHING
    if policy == "full":
        return FULL
    if policy == "op":
        return Reissue(gathers=BLOCKS) if sp else Reissue(reduces=BLOCKS)
    out = NOTHING
    for module in modules_of(policy):
        out = out | MODULE_REISSUE[module](moe_layer)
    return out
