"""Which layers are recomputed: the one answer every consumer asks (memory, the engine's
tasks, the analytic estimate, hardware FLOPs, the memory timeline, the ops table).

``parallel.recompute`` names the mode (none, selective, full). Two fields recompute only
some layers in full and leave the others as they are without recomputation, as the
frameworks' configs say it:

* ``parallel.recompute_num_layers`` N: Megatron-LM's ``--recompute-granularity full
  --recompute-method block --recompute-num-layers N``. ``checkpointed_forward``
  (``megatron/core/recompute.py``, lines 167-179 at commit d98e8a64 of 2026-08-22; before,
  ``TransformerBlock._checkpointed_forward`` in
  ``megatron/core/transformer/transformer_block.py``) walks
  ``range(self.num_layers_per_pipeline_rank)``, which is ``len(self.layers)``, the layers
  of the block (``transformer_block.py`` line 334), one model chunk (one virtual stage
  when interleaved), and checkpoints layer ``l`` when ``l < recompute_num_layers`` (past
  the layers an FP8 run skips, not modelled): the first N layers of each chunk, all of
  them when N is at least the chunk's layers.
* ``parallel.recompute_every`` k: torchtitan's ``activation_checkpoint.mode =
  "selective"`` with an integer ``selective_ac_option``. ``_apply_layer_sac``
  (``torchtitan/distributed/activation_checkpoint.py`` at commit 01db32e9) counts the
  blocks ``apply_ac`` passes it in the module-level ``_layer_sac_count`` (before, in
  ``_apply_ac_to_transformer_block``, the function attribute
  ``ptd_checkpoint_wrapper._count``): one counter per process, which runs on across the
  model chunks a pipeline rank builds, and wraps a block when ``count % ac_freq == 0``:
  the k-th, 2k-th, ... layer of each rank, counted from 1 over its chunks in chunk
  order.

Without either field every layer has ``parallel.recompute`` and the callers' paths are
the ones they had before (:func:`partial` is false). A third field recomputes every
layer but keeps fewer inputs: ``parallel.recompute_group`` N, Megatron-LM's
``--recompute-method uniform --recompute-num-layers N`` (the same
``checkpointed_forward``, lines 157-166: ``chunk_runner(l, min(l + N, L), True)``, a
checkpointed call over each group), one
input per group of N layers of a chunk (:func:`kept_runs`).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, get_args

from simulator.errors import Problem
from simulator.schedules.action import stage_rank
from simulator.schedules.registry import schedule_spec
from simulator.spec.placement import chunk_layers, model_stages, rank_virtual_stages, stage_layers

if TYPE_CHECKING:
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.scenario import ParallelSpec

#: a layer's recomputation policy: ``parallel.recompute``'s mode, or ``selective:<modules>``
#: for Megatron's modules (:func:`policy`); what each re-runs and keeps is
#: :mod:`simulator.model.inventory.recompute_policy`'s
Policy = str

#: (policy, the layer runs with it), in a fixed order: hashable, for cached callers
ModeRuns = tuple[tuple[Policy, tuple[range, ...]], ...]


def module_names() -> tuple[str, ...]:
    """``parallel.recompute_modules``' choices, in the order a policy names them."""
    from simulator.spec.scenario import RecomputeModule  # the field's choices, in order

    return get_args(RecomputeModule)


def policy(par: ParallelSpec) -> Policy:
    """The policy of ``parallel.recompute`` with ``parallel.recompute_modules``: plain
    ``selective`` for Megatron's default (``[core_attn]``, or none given), else
    ``selective:`` and the modules in the field's order."""
    modules = par.recompute_modules
    if par.recompute != "selective" or modules is None or tuple(modules) == ("core_attn",):
        return par.recompute
    return "selective:" + ",".join(m for m in module_names() if m in modules)


def modules_of(policy: Policy) -> tuple[str, ...]:
    """The Megatron modules a selective ``policy`` recomputes (none for another)."""
    if policy == "selective":
        return ("core_attn",)
    if policy.startswith("selective:"):
        return tuple(m for m in policy.split(":", 1)[1].split(",") if m)
    return ()


def partial(par: ParallelSpec) -> bool:
    """Whether only some layers are recomputed (either field set)."""
    return par.recompute_num_layers is not None or par.recompute_every is not None


def _virtual_stage(layers: int, par: ParallelSpec, layer: int) -> int:
    if par.layers_per_stage is None:
        return layer // (layers // model_stages(par))
    return bisect.bisect_right(par.layer_starts, layer) - 1


def _before(layers: int, par: ParallelSpec, stage: int) -> int:
    """Layers the rank of virtual ``stage`` holds in its chunks before it."""
    rank = stage_rank(schedule_spec(par.schedule).placement, par.pp, par.virtual_stages,
                      stage)
    chunks = rank_virtual_stages(par, rank)
    return sum(len(chunk_layers(layers, par, c)) for c in chunks[:chunks.index(stage)])


def _position(layers: int, par: ParallelSpec, layer: int) -> int:
    """0-based position of ``layer`` among those its framework counts: its chunk's
    (block) or its pipeline rank's, chunks in order (every)."""
    stage = _virtual_stage(layers, par, layer)
    within = layer - chunk_layers(layers, par, stage).start
    if par.recompute_every is None:
        return within
    return _before(layers, par, stage) + within


def layer_mode(par: ParallelSpec, layers: int, layer: int) -> Policy:
    """The recompute policy of global ``layer`` (0 .. layers − 1) of a model of ``layers``;
    a multi-token prediction layer (``layer`` >= ``layers``) takes the policy of
    ``parallel.recompute`` whole: Megatron-LM checkpoints each MTP module under full
    granularity whatever the method and count (``MultiTokenPredictionLayer.forward``)."""
    if not partial(par) or layer >= layers:
        return policy(par)
    position = _position(layers, par, layer)
    if par.recompute_every is not None:
        chosen = (position + 1) % par.recompute_every == 0
    else:
        chosen = position < (par.recompute_num_layers or 0)
    return par.recompute if chosen else "none"


def _chunk_pieces(par: ParallelSpec, layers: int, run: range) -> list[tuple[Policy, range]]:
    """A whole model chunk's layers by mode, in closed form: two runs (block), or every
    k-th layer as one stepped range and the rest as the gaps between them or as k − 1
    stepped ranges, whichever are fewer (at most about √(layers) ranges)."""
    if run.stop > layers:  # the multi-token prediction layers: as layer_mode says
        main = range(run.start, min(run.stop, layers))
        tail = range(max(run.start, layers), run.stop)
        return [*(_chunk_pieces(par, layers, main) if main else []), (par.recompute, tail)]
    a, b = run.start, run.stop
    if par.recompute_every is None:
        cut = min(a + (par.recompute_num_layers or 0), b)
        return [(par.recompute, range(a, cut)), ("none", range(cut, b))]
    k = par.recompute_every
    first = a + (k - 1 - _before(layers, par, _virtual_stage(layers, par, a))) % k
    chosen = range(first, b, k)
    if not chosen:
        return [("none", run)]
    if len(chosen) + 1 <= k - 1:  # the gaps between the chosen layers
        rest = [range(a, first)] + [range(c + 1, min(c + k, b)) for c in chosen]
    else:  # one stepped range per other residue
        rest = [range(r if r >= a else r + k, b, k) for r in range(first - k + 1, first)]
    return [(par.recompute, chosen), *(("none", r) for r in rest)]


def mode_runs(par: ParallelSpec, layers: int, runs: list[range]) -> ModeRuns:
    """Whole model chunks ``runs`` (layer ranges) cut into runs of one mode (stepped ranges
    for every k-th layer), grouped by mode; one group, the runs as given, without
    :func:`partial`."""
    if not partial(par):
        return ((policy(par), tuple(runs)),)
    groups: dict[Policy, list[range]] = {}
    for run in runs:
        if run:
            for mode, piece in _chunk_pieces(par, layers, run):
                if piece:
                    groups.setdefault(mode, []).append(piece)
    return tuple((mode, tuple(rs)) for mode, rs in groups.items())


def stage_modes(par: ParallelSpec, layers: int, rank: int, mtp: int = 0) -> ModeRuns:
    """The layers of pipeline ``rank`` (with ``mtp`` multi-token prediction layers on the
    output layer's) grouped by their recompute mode."""
    return mode_runs(par, layers, stage_layers(layers, par, rank, mtp))


def model_modes(par: ParallelSpec, layers: int, mtp: int = 0) -> ModeRuns:
    """Every layer of the model (and its ``mtp`` multi-token prediction layers) grouped by
    its recompute mode."""
    if not partial(par):
        return mode_runs(par, layers, [range(layers + mtp)])
    return mode_runs(par, layers, [chunk_layers(layers, par, k, mtp)
                                   for k in range(model_stages(par))])  # DualPipe: once


def chunks_alike(par: ParallelSpec, layers: int) -> bool:
    """Whether every virtual stage recomputes as many layers (always without
    :func:`partial`; every k-th layer of a rank can fall unevenly on its chunks)."""
    if not partial(par):
        return True
    counts = {sum(len(r) for mode, rs in mode_runs(par, layers, [chunk_layers(layers, par, k)])
                  if mode != "none" for r in rs)
              for k in range(model_stages(par))}
    return len(counts) == 1


def recomputed_share(par: ParallelSpec, layers: int) -> float:
    """The fraction of the model's layers recomputed in full (for the per-layer closed
    forms that average over a stage: context parallelism's exposed exchange, ZeRO-3's
    module gathers); 1 or 0 without :func:`partial`."""
    if not partial(par):
        return 1.0 if par.recompute == "full" else 0.0
    return sum(len(r) for mode, runs in model_modes(par, layers) if mode == "full"
               for r in runs) / layers


def flops_modes(par: ParallelSpec, layers: int, mtp: int = 0) -> ModeRuns | None:
    """:func:`model_modes` when only some layers are recomputed, else None (the FLOP
    counts' own whole-model path)."""
    return model_modes(par, layers, mtp) if partial(par) else None


def describe(par: ParallelSpec) -> str:
    """The recompute mode in words: ``full``, or which layers."""
    if par.recompute_num_layers is not None:
        return f"{par.recompute} (first {par.recompute_num_layers} layers of each chunk)"
    if par.recompute_every is not None:
        return f"{par.recompute} (one layer in {par.recompute_every} of each rank)"
    if par.recompute_group is not None:
        return f"{par.recompute} (groups of {par.recompute_group} layers)"
    if par.recompute == "op":
        return "op (torchtitan's per-op policy)"
    modules = modules_of(policy(par))
    if par.recompute == "selective" and modules != ("core_attn",):
        return f"selective ({', '.join(modules) or 'no modules'})"
    return par.recompute


def kept_runs(par: ParallelSpec, runs: tuple[range, ...]) -> tuple[range, ...]:
    """The layers of whole model chunks ``runs`` that keep activations: all of them, or
    with ``parallel.recompute_group`` N the first of each group of N (Megatron-LM's
    uniform method: ``checkpointed_forward`` checkpoints each group as one call, which
    saves that call's input, the group's first layer's)."""
    if par.recompute_group is None or par.recompute != "full":
        return runs
    return tuple(range(r.start, r.stop, par.recompute_group) for r in runs)


def keeps(par: ParallelSpec, layers: int, layer: int) -> bool:
    """Whether ``layer`` keeps activations (:func:`kept_runs`)."""
    if par.recompute_group is None or par.recompute != "full" or layer >= layers:
        return True  # a multi-token prediction module checkpoints its own input
    stage = _virtual_stage(layers, par, layer)
    return (layer - chunk_layers(layers, par, stage).start) % par.recompute_group == 0


def recompute_problems(par: ParallelSpec) -> list[Problem]:
    """The partial-recompute fields need recompute: full, and only one of them."""
    out: list[Problem] = []
    fields = (("recompute_num_layers", par.recompute_num_layers),
              ("recompute_every", par.recompute_every),
              ("recompute_group", par.recompute_group))
    for name, value in fields:
        if value is not None and par.recompute != "full":
            out.append(Problem(f"parallel.{name}", value, "recomputes layers in full; "
                               f"needs parallel.recompute: full (it is {par.recompute}); set "
                               f"it, or remove {name}"))
    if par.recompute_modules is not None and par.recompute != "selective":
        out.append(Problem("parallel.recompute_modules", list(par.recompute_modules),
                           "are Megatron's selective recomputation (--recompute-granularity "
                           f"selective); needs parallel.recompute: selective (it is "
                           f"{par.recompute}); set it, or remove recompute_modules"))
    given = [(name, value) for name, value in fields if value is not None]
    if len(given) > 1:
        (first, _), (name, value) = given[0], given[1]
        out.append(Problem(f"parallel.{name}", value, f"contradicts parallel.{first} "
                           "(Megatron's block and uniform methods and torchtitan's every "
                           "k-th layer choose the recomputed layers each their way); keep one"))
    return out


def model_problems(model: ModelSpec, par: ParallelSpec, fp8: str = "none") -> list[Problem]:
    """Policies the model's layers cannot run: Megatron's ``mla_up_proj`` needs latent
    attention and its ``layernorm`` and ``moe_act`` FP8 scaling other than delayed
    (``TransformerConfig.__post_init__`` raises likewise); torchtitan's per-op policy is
    modelled on dense layers with standard attention."""
    out: list[Problem] = []
    discarding = [m for m in modules_of(policy(par)) if m in ("layernorm", "moe_act")]
    if discarding and fp8 == "delayed":
        out.append(Problem("parallel.recompute_modules", list(par.recompute_modules or ()),
                           f"{' and '.join(discarding)} discard FP8 outputs, which delayed "
                           "scaling does not support (Megatron refuses it); use another "
                           "stack.fp8 recipe or remove them"))
    if "mla_up_proj" in modules_of(policy(par)) and model.mla is None:
        out.append(Problem("parallel.recompute_modules", list(par.recompute_modules or ()),
                           "mla_up_proj recomputes latent attention's up-projections; the "
                           "model has none (model.mla unset): remove mla_up_proj"))
    if par.recompute == "op" and (model.is_moe or model.mla is not None):
        out.append(Problem("parallel.recompute", "op", "torchtitan's per-op policy is "
                           "modelled on dense layers with standard attention (this model has "
                           "routed experts or latent attention); use selective or full"))
    return out
