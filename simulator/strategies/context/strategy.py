"""Context parallelism as a strategy: Megatron-LM's rules for splitting the sequence,
what it cannot run yet, its pass, its closed-form term (a layer's exposed key/value
exchange) and the search over CP degrees.

CP degrees searched by default: powers of two while each CP rank keeps at least
:data:`CP_MIN_TOKENS` tokens of a sequence, so a 2,048- or 4,096-token model gets none
and an 8,192-token one CP 2. The shortest chunks of published CP runs are that long:
NeMo's ``llm/recipes/llama3_70b.py`` pre-trains at 8,192 tokens with
``context_parallelism=2``, and the Llama 3 report (Table 4) runs 131,072 tokens at CP 16
(8,192 a rank); shorter chunks only add KV exchange to thinner GEMMs. Where the
simulator has no CP workload for the model (a mixture of experts, latent attention) the
default is CP 1.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from simulator.errors import Problem
from simulator.model.inventory.attention import cp_a2a_bytes, cp_kv_bytes
from simulator.model.inventory.recompute_comm import reissued
from simulator.spec.recompute import partial, policy, recomputed_share
from simulator.spec.scenario import ParallelSpec, Scenario
from simulator.strategies.base import Dimension, Strategy
from simulator.strategies.context.workload import ContextParallelPass
from simulator.strategies.timing import collective_time
from simulator.system.hardware import HardwareProfile
from simulator.system.layout import Layout

if TYPE_CHECKING:
    from simulator.builder.context import Context, Pass
    from simulator.builder.workload import BlockCosts

CP_MIN_TOKENS = 4096  # default CP: each rank keeps at least this many tokens (module note)


def context_parallel_problems(s: Scenario) -> list[Problem]:
    """Megatron-LM splits the sequence into 2 · cp chunks (rank r takes chunks r and
    2cp − 1 − r, balancing causal attention), each divisible by tp with sequence
    parallelism; the all-to-all variants' rules are :func:`a2a_problems`."""
    par, mdl = s.parallel, s.model
    out = a2a_problems(s)
    if par.cp == 1:
        return out
    if mdl.seq_len % (2 * par.cp):
        out.append(Problem("parallel.cp", par.cp, f"model.seq_len ({mdl.seq_len}) is not "
                           f"divisible by 2 * cp = {2 * par.cp} (two balanced chunks per rank); "
                           "change cp or seq_len"))
    elif par.sequence_parallel and (mdl.seq_len // par.cp) % par.tp:
        out.append(Problem("parallel.cp", par.cp, f"seq_len / cp = {mdl.seq_len // par.cp} is "
                           f"not divisible by tp({par.tp}) under sequence_parallel; change cp, "
                           "tp or seq_len"))
    return out


def a2a_problems(s: Scenario) -> list[Problem]:
    """``cp_a2a`` only with a2a+p2p, which needs it, dividing cp (Megatron-LM:
    the product of ``--hierarchical-context-parallel-sizes`` is cp); the all-to-all
    splits each TP rank's query heads and key/value heads over its ranks, so both must
    divide (Transformer Engine's ``AttnFuncWithCPAndQKVOA2A``: "requires num_heads %
    cp_size == 0 for Q, K, V")."""
    par, mdl = s.parallel, s.model
    hierarchical = par.cp_comm_type == "a2a+p2p"
    if not hierarchical and par.cp_a2a is not None:
        return [Problem("parallel.cp_a2a", par.cp_a2a, "is the all-to-all's degree of "
                        "cp_comm_type a2a+p2p only; drop it or set parallel.cp_comm_type: "
                        "a2a+p2p")]
    if hierarchical and par.cp > 1 and (par.cp_a2a is None or par.cp % par.cp_a2a):
        return [Problem("parallel.cp_a2a", par.cp_a2a, "a2a+p2p needs the all-to-all's "
                        f"degree, a divisor of cp({par.cp}) (Megatron-LM's "
                        "--hierarchical-context-parallel-sizes A R, A · R = cp); set "
                        "parallel.cp_a2a")]
    a = par.cp_a2a_degree
    heads, kv = mdl.heads // par.tp, max(mdl.kv // par.tp, 1)
    if a == 1 or not (heads % a or kv % a):
        return []
    field = "parallel.cp_comm_type" if par.cp_comm_type == "a2a" else "parallel.cp_a2a"
    value = par.cp_comm_type if par.cp_comm_type == "a2a" else par.cp_a2a
    most = math.gcd(heads, kv, par.cp)  # the largest all-to-all these heads allow
    fix = f"cp_comm_type a2a+p2p with cp_a2a dividing {most}, " if most > 1 else ""
    return [Problem(field, value, f"the all-to-all splits each TP rank's {heads} query and "
                    f"{kv} key/value heads over {a} CP ranks; both must be divisible by {a}: "
                    f"use {fix}p2p or allgather, or a smaller tp")]


def cp_exposed(s: Scenario, layout: Layout, c: BlockCosts,
               hw: HardwareProfile) -> tuple[float, float]:
    """One layer's exposed context-parallel exchange per micro-batch, all passes
    (:mod:`simulator.strategies.context.workload`): a ring beyond what its attention block
    hides (twice the bytes in backward), or the blocking all-gathers and the
    gradients' reduce-scatter (and the backward's all-gather unless the stack keeps the
    gathered keys and values); with the all-to-all variants, their blocking
    all-to-alls besides (:func:`a2a_exposed`); and of it, what the recomputation exchanges
    again before the backward (full recomputation's forward passes, or a finer policy that
    re-runs the core). ``s`` is the rank's local view (seq_len / cp)."""
    par, trn = s.parallel, s.training
    if par.cp == 1:
        return 0.0, 0.0
    a2a = par.cp_a2a_degree
    size = par.cp // a2a * cp_kv_bytes(s.model, trn.micro_batch, par.tp, trn.dtype)
    inner, group = layout.cp_a2a_group(0), layout.cp_ring_group(0)
    # forward passes of a layer: again when recomputed (on average over the layers when
    # only some are, simulator.spec.recompute); a finer policy that re-runs the core
    # (Megatron's core_attn) exchanges once more, beside the recomputed core
    fwd_passes = 1 + recomputed_share(par, s.model.layers) if partial(par) \
        else 2 if par.recompute == "full" else 1
    core = 1 if par.recompute != "full" and \
        reissued(policy(par), False, par.sequence_parallel).cp else 0
    extra = fwd_passes - 1 + core  # the passes the recomputation adds
    if par.cp_comm_type == "allgather":
        ag = collective_time(s, layout, "all_gather", size, group, hw)
        rs = collective_time(s, layout, "reduce_scatter", size, group, hw)
        regather = 0 if s.cp_keeps_gathered_kv else 1  # the backward's all-gather
        return (fwd_passes + core + regather) * ag + rs, extra * ag
    one = a2a_exposed(s, layout, inner, hw, 0.0)  # one pass's all-to-alls
    exposed = (fwd_passes + core + 1) * one
    if par.cp_comm_type == "a2a":
        return exposed, extra * one
    ring_f = collective_time(s, layout, "all_gather", size, group, hw)
    ring_b = collective_time(s, layout, "all_gather", 2 * size, group, hw)
    lc = c.layer(0)
    ring = max(0.0, ring_f - lc.fwd[0])  # a forward's ring beyond its attention block
    again = core * max(0.0, ring_f - lc.recompute[0])
    return exposed + fwd_passes * ring + max(0.0, ring_b - lc.bwd_input[0]
                                             - lc.bwd_weight[0]) + again, \
        extra * one + (fwd_passes - 1) * ring + again


def a2a_exposed(s: Scenario, layout: Layout, group: tuple[int, ...], hw: HardwareProfile,
                fwd_passes: float) -> float:
    """The all-to-alls of one layer and micro-batch, blocking: Q, K, V and O in each
    forward pass, dO, dQ, dK and dV in the backward, one collective each (0 over a
    group of one)."""
    par, trn = s.parallel, s.training
    q, kv = cp_a2a_bytes(s.model, trn.micro_batch, par.tp, trn.dtype)
    one = sum(collective_time(s, layout, "all_to_all", n, group, hw) for n in (q, kv, kv, q))
    return (fwd_passes + 1) * one


class ContextParallel(Strategy):
    name = "context"
    kinds = ("cp",)

    def active(self, s: Scenario) -> bool:
        return s.parallel.cp > 1

    def problems(self, s: Scenario) -> list[Problem]:
        return context_parallel_problems(s)

    def unsupported(self, s: Scenario) -> list[Problem]:
        par, mdl = s.parallel, s.model
        if par.cp == 1 or not (mdl.is_moe or mdl.mla is not None):
            return []
        return [Problem("parallel.cp", par.cp, "not yet simulated with a mixture of experts "
                        "or latent attention (the expert grid and the latent attention core "
                        "under CP are not modelled); use cp: 1")]

    def make_pass(self, ctx: Context) -> Pass | None:
        return ContextParallelPass(ctx)

    def dimensions(self) -> tuple[Dimension, ...]:
        return (Dimension(("cp",), ("parallel.cp",), 20,
                          lambda req, base, chosen: ((cp,) for cp in cp_degrees(req, base))),)


def cp_degrees(req: Any, base: Scenario) -> tuple[int, ...]:
    """The CP degrees to try: the request's, or the default of the module note."""
    if req.context_parallel is not None:
        return tuple(req.context_parallel)
    if CONTEXT.unsupported(base.model_copy(update={"parallel": ParallelSpec(cp=2)})):
        return (1,)
    out = [1]
    while base.model.seq_len // (2 * out[-1]) >= CP_MIN_TOKENS:
        out.append(2 * out[-1])
    return tuple(out)


CONTEXT = ContextParallel()
