"""Layer placement: which transformer layers each pipeline stage holds.

The model's layers are cut into pp · v consecutive runs, one per virtual stage
(v = ``parallel.virtual_stages``; virtual stage k = chunk · pp + rank, as
Megatron-LM interleaves them): virtual stage k holds the ``counts[k]`` layers
that follow those of the stages before it, and pipeline rank r holds the
virtual stages r, r + pp, r + 2·pp, ... A schedule with a V placement (ZB-V, its
registry entry's ``placement``) gives rank r the virtual stages r and 2·pp − 1 − r
instead: the first and the last stage, with the embedding and the output layer,
then sit on rank 0 (:func:`head_rank`). A schedule with two directions (DualPipe, its
entry's ``directions``) runs every micro-batch through the whole model from either end:
the model is cut into pp · v / 2 model stages and virtual stage k holds the layers of
model stage k mod (pp · v / 2), so each rank holds two model stages (r and pp − 1 − r,
the parameters twice over) and ranks 0 and pp − 1 each hold the embedding and the
output layer (:func:`holds_embedding`, :func:`holds_head`).

Without ``parallel.layers_per_stage`` every virtual stage holds layers / (pp · v)
layers, and a count that does not divide is refused (Megatron-LM's default
split). With it, the user lists the counts (pp entries, or pp · v for an
interleaved schedule, in virtual-stage order), non-negative and summing to
``model.layers``, as Megatron-LM's uneven split allows:
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
(``num_layers_in_first_pipeline_stage`` / ``..._last_...`` of its
``TransformerConfig``, read by ``get_num_layers_to_build`` in
``megatron/core/transformer/transformer_block.py``) take layers off the first
and last stage, which also carry the embedding and the output layer; and
``--pipeline-model-parallel-layout``
(``megatron/core/transformer/pipeline_parallel_layer_layout.py``) names the
layers of every virtual stage, an empty one included (Megatron builds an
identity there). A stage without layers, embedding or head relays activations
and gradients unchanged (:mod:`simulator.strategies.pipeline.workload` gives it zero-second
tasks).

The multi-token prediction modules' layers (``model.mtp_layers``, numbered from
``model.layers`` on) follow the last virtual stage's, with the output layer, as
Megatron-LM places them.

Every lookup is O(1) per virtual stage (the running sums are computed once per
``ParallelSpec``), so placement costs nothing against a 100,000-stage pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from simulator.errors import Problem
from simulator.schedules.action import rank_stages, stage_rank
from simulator.schedules.registry import schedule_spec

if TYPE_CHECKING:
    from simulator.spec.model_spec import ModelSpec
    from simulator.spec.scenario import ParallelSpec

FIELD = "parallel.layers_per_stage"


def model_stages(par: ParallelSpec) -> int:
    """How many runs the layers are cut into: pp · v, or pp · v / 2 with two directions."""
    return par.pp * par.virtual_stages // schedule_spec(par.schedule).directions


def chunk_layers(layers: int, par: ParallelSpec, stage: int, mtp: int = 0) -> range:
    """The layers of virtual ``stage`` (0 .. pp · v − 1; with two directions those of
    model stage ``stage`` mod :func:`model_stages`); the last model stage also holds the
    ``mtp`` multi-token prediction modules' layers, numbered ``layers`` onwards (Megatron-LM
    builds them on the last pipeline stage, ``mtp_on_this_rank`` and
    ``get_mtp_num_layers_to_build`` in megatron/core/transformer/multi_token_prediction.py)."""
    runs = model_stages(par)
    stage %= runs
    if par.layers_per_stage is None:
        per = layers // runs
        run = range(stage * per, (stage + 1) * per)
    else:
        starts = par.layer_starts
        run = range(starts[stage], starts[stage + 1])
    if mtp and stage == runs - 1:
        return range(run.start, layers + mtp)
    return run


def rank_virtual_stages(par: ParallelSpec, rank: int) -> list[int]:
    """The virtual stages pipeline ``rank`` holds under the schedule's placement."""
    return rank_stages(schedule_spec(par.schedule).placement, par.pp, par.virtual_stages,
                       rank)


def head_rank(par: ParallelSpec) -> int:
    """The pipeline rank of the last virtual stage (the output layer): pp − 1, or 0 under
    a V placement."""
    last = par.pp * par.virtual_stages - 1
    return stage_rank(schedule_spec(par.schedule).placement, par.pp, par.virtual_stages,
                      last)


def holds_head(par: ParallelSpec, rank: int) -> bool:
    """Whether pipeline ``rank`` holds the output layer (the last virtual stage; with two
    directions, the last of either: ranks 0 and pp − 1)."""
    if schedule_spec(par.schedule).directions == 2:
        return rank in (0, par.pp - 1)
    return rank == head_rank(par)


def holds_embedding(par: ParallelSpec, rank: int) -> bool:
    """Whether pipeline ``rank`` holds the embedding (the first virtual stage; with two
    directions, the first of either: ranks 0 and pp − 1)."""
    if schedule_spec(par.schedule).directions == 2:
        return rank in (0, par.pp - 1)
    return rank == 0


def stage_ends(par: ParallelSpec, rank: int) -> tuple[bool, bool]:
    """Whether pipeline ``rank`` holds the embedding and the output layer."""
    return holds_embedding(par, rank), holds_head(par, rank)


def tied_copy(par: ParallelSpec) -> bool:
    """Whether a tied word embedding needs Megatron's copy on the output layer's rank
    (the embedding and the output layer on different ranks)."""
    return head_rank(par) != 0


def embedding_copy_params(spec: ModelSpec, par: ParallelSpec) -> int:
    """Parameters of Megatron's word-embedding copy on the output layer's rank: the
    embedding's where that rank uses it (a tied output layer, multi-token prediction)
    and is not the first's (:func:`tied_copy`); 0 otherwise."""
    return spec.vocab * spec.hidden if spec.head_needs_embedding and tied_copy(par) else 0


#: :func:`stage_layers` by the fields it reads: a planner asks it of every stage of every
#: candidate, and most share a placement
_RUNS: dict[tuple[Any, ...], tuple[range, ...]] = {}


def stage_layers(layers: int, par: ParallelSpec, rank: int, mtp: int = 0) -> list[range]:
    """The layer runs of pipeline ``rank``: one per model chunk it holds, in chunk order
    (the last with the ``mtp`` multi-token prediction layers, :func:`chunk_layers`; they
    read ``pp``, ``virtual_stages``, ``schedule`` and ``layers_per_stage`` of ``par``)."""
    key = (layers, par.pp, par.virtual_stages, par.schedule, par.layers_per_stage, rank, mtp)
    runs = _RUNS.get(key)
    if runs is None:
        if len(_RUNS) >= 65_536:
            _RUNS.clear()
        runs = _RUNS[key] = tuple(chunk_layers(layers, par, st, mtp)
                                  for st in rank_virtual_stages(par, rank))
    return list(runs)


def stage_layer_count(layers: int, par: ParallelSpec, rank: int, mtp: int = 0) -> int:
    """How many layers pipeline ``rank`` holds, all its chunks together."""
    return sum(len(r) for r in stage_layers(layers, par, rank, mtp))


def is_even(par: ParallelSpec) -> bool:
    """True when every virtual stage holds the same number of layers."""
    counts = par.layers_per_stage
    return counts is None or min(counts) == max(counts)


def _shown(counts: tuple[int, ...]) -> str:
    if len(counts) <= 12:
        return "[" + ", ".join(map(str, counts)) + "]"
    return "[" + ", ".join(map(str, counts[:6])) + f", ... ({len(counts)} entries)]"


def placement_problems(layers: int, par: ParallelSpec) -> list[Problem]:
    """The placement against the model and the degrees; each problem names the fix."""
    chunks = model_stages(par)
    counts = par.layers_per_stage
    if counts is None:
        if layers % chunks == 0:
            return []
        cut = f"pp({par.pp}) * virtual_stages({par.virtual_stages}) = {chunks}" \
            if chunks == par.pp * par.virtual_stages else f"pp({par.pp}), the model stages"
        return [Problem("model.layers", layers, f"not divisible by {cut}; set {FIELD} to "
                        f"{chunks} layer counts summing to {layers} (an uneven split), or "
                        "choose layers a multiple of it or other degrees")]
    if len(counts) != chunks:
        what = f"pp({par.pp}) entries, one per stage" if chunks == par.pp else \
            f"pp({par.pp}) * virtual_stages({par.virtual_stages}) = {chunks} entries, one " \
            "per virtual stage in virtual-stage order (chunk * pp + rank)"
        return [Problem(FIELD, _shown(counts), f"has {len(counts)} entries; it needs {what}")]
    if sum(counts) != layers:
        return [Problem(FIELD, _shown(counts), f"sums to {sum(counts)} layers, not "
                        f"model.layers ({layers}); make the counts add up to {layers}")]
    return []
