"""How big a simulation would be, computed from the scenario before anything is built.

A schema-valid scenario can still ask for a run that never finishes:
``global_batch: 800000000`` is 800 million micro-batches to schedule, ``layers:
1000000000`` a billion layer blocks per micro-batch. The engine builds every task
of every simulated rank up front (about 1.5 KB each with the engine's state and
the span table; about 360 bytes at full fidelity, where each stage's ranks share one
prototype program), so the cost is known before building: tasks ≈ simulated ranks ×
(micro-batches × layers per stage × tasks per layer + a per-rank constant).

Tasks per layer and micro-batch, from the builder's expansion (workload.py):
forward and backward are one block each without TP, two blocks and two TP
collectives each with TP (four with sequence parallelism); full recomputation
repeats the forward, selective adds one block (and the collectives a module's
checkpointed function re-issues); ZB-H1 adds a weight-gradient
block; with DP, ZeRO-2/3 reduce gradients per micro-batch and ZeRO-3 gathers
each unit before forward and backward; sends and bookkeeping add one or two.
On the bundled scenarios this is within 12% of the built count (tested to 30%).

Above :data:`DEFAULT_MAX_TASKS` (above ``gpt3-175b-1024`` at full fidelity with full
recomputation, ~1.5e7 tasks, and below the 16,384-GPU Llama 3 scenarios' ~3e7)
``clustersim run`` refuses with one line saying how big the run would be and how
to proceed: ``--fidelity folded`` (one rank per stage), ``--method analytic``, or
``--max-tasks N`` to accept it. The analytic method and the memory table cost
O(pipeline stages), which :data:`MAX_STAGES` bounds for every command.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.builder.workload import simulated_count
from simulator.errors import Problem, UserError
from simulator.model.inventory.recompute_comm import reissued
from simulator.model.inventory.sharding import zero3_collectives
from simulator.schedules.registry import schedule_spec
from simulator.spec.base import MAX_STAGES
from simulator.spec.placement import stage_layer_count
from simulator.spec.recompute import policy
from simulator.spec.scenario import Scenario
from simulator.strategies import registry
from simulator.strategies.tensor import overlap as tp_overlap

DEFAULT_MAX_TASKS = 25_000_000
BYTES_PER_TASK = 1_600  # task, engine state and span row; measured on llama2-70b-128xh100
# a full-fidelity run whose stages share one prototype program (no object per task: the
# engine's arrays, the accounting's columns, the span table and its Parquet writer), peak
# resident bytes per task of `clustersim run --fidelity full`, measured 2026-12-06: GPT-3
# on 1,024 GPUs 5.0 GB for 14.6M tasks (342), Llama 3 405B on 16,384 11.1 GB for 31.3M (355)
BYTES_PER_SHARED_TASK = 360


@dataclass(frozen=True)
class Cost:
    """The size of an engine run: simulated ranks, tasks, and memory in bytes (``shared``:
    the stages share prototype programs, :mod:`simulator.builder.program`)."""

    ranks: int
    tasks: int
    shared: bool = False

    @property
    def memory_bytes(self) -> int:
        return self.tasks * (BYTES_PER_SHARED_TASK if self.shared else BYTES_PER_TASK)


def tasks_per_layer(s: Scenario) -> int:
    """Tasks of one layer for one micro-batch on one rank (see the module notes)."""
    par = s.parallel
    forward = 1
    if par.tp > 1:  # attention and MLP blocks, each with its TP collective(s)
        forward = 6 if par.sequence_parallel else 4
    n = 2 * forward + (1 if par.tp > 1 else 2)
    # selective and per-op: one task, two with an MLP block's modules
    n += {"none": 0, "selective": 1 if policy(par) == "selective" else 2,
          "op": 2, "full": forward}[par.recompute]
    again = reissued(policy(par), False, par.sequence_parallel)
    if par.tp > 1 and par.recompute != "full":  # the TP collectives a finer policy re-issues
        n += len(again.blocks) * (2 if par.sequence_parallel else 1) + len(again.gathers) \
            + len(again.reduces)
    if schedule_spec(par.schedule).split_backward:  # a W action per layer
        n += 1
    if par.dp > 1 and par.zero >= 2:  # ZeRO-3: two gathers and a reduce-scatter per part
        n += 3 * zero3_collectives(s.model, s.stack) if par.zero == 3 else 1
        if par.zero == 3 and zero3_collectives(s.model, s.stack) > 1:
            n += 2  # module units: the MLP block's zero3.wait, forward and backward
    if tp_overlap.active(s):  # per block and pass, the split pieces, side collectives, waits
        # (Megatron's async backward: per backward block the weight-gradient piece and the
        # wait, the collective moved off the compute stream)
        n += 2 * 2 if s.stack.tp_overlap == "async" else \
            2 * 5 * (3 if par.recompute == "full" else 2)
    if s.model.is_moe:  # per MoE layer and pass: all-to-all, experts, all-to-all (+ gather,
        # scatter with expert TP), averaged over the layers
        per_pass = 3 + (2 if par.etp > 1 else 0)
        passes = 3 if "mlp" in reissued(policy(par), True, par.sequence_parallel).blocks \
            else 2
        n += -(-per_pass * passes * s.model.moe_layers // s.model.layers)
    return n + sum(strategy.tasks_per_layer(s) for strategy in registry.strategies())


def engine_cost(s: Scenario, fidelity: str) -> Cost:
    """Estimated size of the engine's workload for ``s`` at ``fidelity``."""
    ranks = simulated_count(s, fidelity)
    per_stage = _most_layers(s)
    # two directions (DualPipe): a micro-batch passes one of the rank's two model stages
    passed = per_stage / schedule_spec(s.parallel.schedule).directions
    per_rank = int(s.microbatches * passed * tasks_per_layer(s)) + 2 * per_stage + 10
    # the builder shares each stage's program at full fidelity but for a mixture of experts
    # (per-rank token loads), simulator.builder.program.share
    shared = fidelity == "full" and ranks > s.parallel.pp and not s.model.is_moe
    return Cost(ranks, ranks * per_rank, shared)


def _most_layers(s: Scenario) -> int:
    """Layers of the fullest pipeline stage (the even split's layers / pp without
    ``parallel.layers_per_stage``)."""
    par = s.parallel
    if par.layers_per_stage is None:
        return s.model.layers // par.pp
    return max(stage_layer_count(s.model.layers, par, r, s.model.mtp_layers) for r in range(par.pp))


def check_stages(s: Scenario) -> None:
    """Refuse pipelines too long for per-stage tables (every method, every command)."""
    stages = s.parallel.pp * s.parallel.virtual_stages
    if stages > MAX_STAGES:
        raise UserError([Problem("parallel.pp", s.parallel.pp, f"pp × virtual_stages = "
                                 f"{stages:,} pipeline stages; at most {MAX_STAGES:,} can be "
                                 "tabulated; use fewer stages")])


def check_engine_cost(s: Scenario, fidelity: str, max_tasks: int | None = None) -> Cost:
    """The run's cost, or a one-line UserError when it is above ``max_tasks``."""
    check_stages(s)
    limit = DEFAULT_MAX_TASKS if max_tasks is None else max_tasks
    cost = engine_cost(s, fidelity)
    if cost.tasks <= limit:
        return cost
    hints = ["--method analytic"]
    if fidelity == "full" and s.parallel.world > s.parallel.pp:
        hints.insert(0, "--fidelity folded")
    hints.append(f"--max-tasks {_round_up(cost.tasks)} to run it anyway")
    raise UserError([Problem(
        "scenario", s.name,
        f"the engine would build about {cost.tasks:.2g} tasks ({cost.ranks:,} simulated "
        f"rank(s) × {s.microbatches:,} micro-batches × {_most_layers(s):,} "
        f"layers per stage), needing about {cost.memory_bytes / 1e9:.3g} GB, above the limit "
        f"of {limit:.2g} tasks; use {', or '.join(hints)}")])


def _round_up(n: int) -> int:
    """A round number at least ``n`` (two significant digits)."""
    scale = 10 ** max(len(str(n)) - 2, 0)
    return -(-n // scale) * scale
