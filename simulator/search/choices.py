"""The values of the planner's own dimensions a request may name, and their defaults
(:mod:`simulator.search.space` searches them). Plain data: ``clustersim plan --help``
reads it without loading the simulator."""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full", "op")
CP_COMM = ("p2p", "allgather", "a2a", "a2a+p2p")
DEFAULT_CP_COMM = ("p2p", "allgather", "a2a")  # a2a+p2p (one row per cp_a2a) on request
DISPATCHERS = ("alltoall", "allgather", "flex")

#: Megatron's ``--recompute-modules`` sets tried beside its default ([core_attn]), each
#: only where the model has every module (``SEP`` joins a set's modules): the norms with
#: the attention core, a dense layer's MLP, a MoE layer's activation, with the norms, and
#: the whole MoE block, latent attention's up-projections
MODULE_SETS = ("core_attn+layernorm", "mlp", "moe_act", "layernorm+moe_act", "moe",
               "mla_up_proj+layernorm+moe_act")
SEP = "+"
