"""``clustersim plan``: search every layout of a model on N GPUs: plan.csv, pareto.png and
the fastest layout that fits."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator.cli.common import (
    Subparsers,
    add_command,
    computed_line,
    int_list,
    positive_int,
    result_cache,
    search_args,
)
from simulator.errors import Problem, UserError
from simulator.limits import MAX_CANDIDATES
from simulator.search.choices import DEFAULT_CP_COMM, DISPATCHERS, MODULE_SETS

HELP = ("search every layout of a model on N GPUs: plan.csv, pareto.png and the fastest "
        "layout that fits")
EXAMPLE = ("examples:\n"
           "  clustersim plan --model gpt3-175b --gpus 1024 --system dgx-a100-80gb "
           "--global-batch 1536\n"
           "  clustersim plan --model llama3-70b --gpus 512 --system dgx-h100 --global-batch "
           "1024 --seq-len 8192 --dask local:2 --out out/llama\n"
           "  clustersim plan --model mixtral-8x7b --gpus 64 --system dgx-h100 --global-batch "
           "256 --expert-parallel 2,4,8\n"
           "  clustersim plan --model my-model.yaml --stack megatron-core --gpus 64 --system "
           "dgx-h100 --global-batch 512 --set parallel.zero=1 --write-scenario best.yaml\n"
           "  clustersim run best.yaml   # the chosen layout: the plan's step time")


def add_parser(sub: Subparsers) -> None:
    q = add_command(sub, "plan", HELP, EXAMPLE)
    q.add_argument("--model", required=True, metavar="PRESET|FILE.yaml",
                   help="model preset (clustersim presets), or a YAML file holding a "
                   "scenario's model section (e.g. {preset: llama2-7b, layers: 40}) or a whole "
                   "scenario (its model section is used)")
    q.add_argument("--stack", default=None, metavar="PRESET",
                   help="training-stack preset (clustersim presets; default the scenario "
                   "default)")
    q.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE", help="override a scenario key (repeatable), as "
                   "run takes it; a searched key (parallel.zero=1, training.micro_batch=2) "
                   "pins that dimension of the search")
    q.add_argument("--gpus", type=int, required=True, help="N, GPUs in all")
    q.add_argument("--system", required=True, help="system preset or hardware-profile YAML")
    q.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    q.add_argument("--seq-len", type=int, default=None, help="default: the model preset's")
    q.add_argument("--top", type=int, default=5,
                   help="re-simulate the K best with the engine (and the best of each ZeRO "
                   "stage and CP degree besides; 0: none)")
    _dimension_args(q)
    q.add_argument("--max-candidates", type=positive_int, default=MAX_CANDIDATES, metavar="N",
                   help=f"refuse a search of more candidate layouts (default {MAX_CANDIDATES:,})")
    q.add_argument("--tp-beyond-node", action="store_true",
                   help="also try TP groups larger than an NVLink domain "
                   "(a node, or a GB200 NVL72 rack)")
    q.add_argument("--headroom", default="5%", metavar="SHARE|GB",
                   help="memory kept free on every GPU for the allocator's fragmentation: a "
                   "share (5%%, the default: Megatron-LM's 1.05 overhead factor) or an amount "
                   "(4GB); no layout returned needs more than capacity less it")
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/plan-<model>-<gpus>)")
    q.add_argument("--write-scenario", type=Path, default=None, metavar="FILE.yaml",
                   help="also write the chosen layout as a scenario `clustersim run` takes "
                   "unchanged (it gives the plan's engine step time)")
    search_args(q)
    q.set_defaults(func=run)


def _dimension_args(q: argparse.ArgumentParser) -> None:
    """The options that narrow or widen one dimension of the search."""
    q.add_argument("--micro-batches", default="1,2,4,8,16", metavar="B1,B2,...",
                   help="micro-batch sizes to try")
    q.add_argument("--context-parallel", default=None, metavar="C1,C2,...",
                   help="CP degrees to try (default: 1, and powers of two while each CP rank "
                   "keeps >= 4096 tokens; 1 for a mixture of experts)")
    q.add_argument("--expert-parallel", default=None, metavar="E1,E2,...",
                   help="EP degrees to try, a mixture of experts only (default: every divisor "
                   "of the experts that divides a stage's cp * dp)")
    q.add_argument("--recompute", default="none,selective,full,op", metavar="M1,M2,...",
                   help="recompute modes to try: none, selective, full, op (torchtitan's "
                   "per-op policy, dense layers with standard attention only; tried only "
                   "where the layout without recomputation does not fit and with full "
                   "recomputation does)")
    q.add_argument("--recompute-modules", default=",".join(MODULE_SETS),
                   metavar="SET1,SET2,...|none",
                   help="Megatron --recompute-modules sets to try with selective beside its "
                   "default core_attn, modules joined by + (core_attn, layernorm, mlp, moe, "
                   "shared_experts, moe_act, mla_up_proj); each only where the model has "
                   "them, where the layout without recomputation does not fit and with full "
                   "recomputation does (default: %(default)s)")
    q.add_argument("--dp-shard", default=None, metavar="D1,D2,...|none",
                   help="HSDP shard-group sizes (parallel.dp_shard) to try under ZeRO-3 "
                   "beside full sharding, each where it divides dp and full sharding fits "
                   "(default: each divisor of dp whose group of tp * cp * dp_shard GPUs is "
                   "whole nodes; none: full sharding only)")
    q.add_argument("--cp-comm", default=",".join(DEFAULT_CP_COMM), metavar="T1,T2,...",
                   help="CP exchanges (parallel.cp_comm_type) to try where cp > 1: p2p, "
                   "allgather, a2a, a2a+p2p (with each cp_a2a strictly between 1 and cp); "
                   "other than p2p only where p2p fits (default: %(default)s)")
    q.add_argument("--moe-dispatchers", default=",".join(DISPATCHERS), metavar="D1,D2,...",
                   help="MoE token dispatchers (parallel.moe_token_dispatcher) to try, a "
                   "mixture of experts only: alltoall, allgather, flex (DeepEP; where "
                   "expert_tp * ep > 1) (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import check_out_dir, default_out_dir
    from simulator.outputs.search_files import write_plan
    from simulator.search.candidates import PlanRequest, base_scenario, candidates
    from simulator.search.executors import open_executor
    from simulator.search.headroom import parse_headroom
    from simulator.search.plan import plan_lines, run_plan
    from simulator.search.space import parse_module_sets, parse_names
    from simulator.spec.rules import batch_warning

    cp, ep = (None if text is None else int_list(flag, text) for flag, text in
              (("--context-parallel", args.context_parallel),
               ("--expert-parallel", args.expert_parallel)))
    req = PlanRequest(args.model, args.gpus, args.system, args.global_batch, args.seq_len,
                      args.top, int_list("--micro-batches", args.micro_batches),
                      recompute=parse_names("--recompute", args.recompute),
                      recompute_modules=parse_module_sets(args.recompute_modules),
                      dp_shard=None if args.dp_shard is None else
                      () if args.dp_shard.strip() == "none" else int_list("--dp-shard",
                                                                          args.dp_shard),
                      cp_comm=parse_names("--cp-comm", args.cp_comm),
                      dispatchers=parse_names("--moe-dispatchers", args.moe_dispatchers),
                      context_parallel=cp, expert_parallel=ep,
                      tp_beyond_node=args.tp_beyond_node, stack=args.stack,
                      sets=tuple(args.overrides),
                      headroom=parse_headroom(args.headroom),
                      max_candidates=args.max_candidates)
    if args.write_scenario is not None and args.write_scenario.suffix not in (".yaml", ".yml"):
        raise UserError([Problem("--write-scenario", str(args.write_scenario),
                                 "must end in .yaml or .yml (a scenario file)")])
    out = args.out or default_out_dir(f"plan-{req.model_name}-{args.gpus}")
    check_out_dir(out)
    # a bad model, stack, system or --set (a pin no candidate has): one line, now
    candidates(req, base := base_scenario(req), variants=False)
    for line in batch_warning(args.global_batch, base.model.seq_len, "--global-batch"):
        print(line, file=sys.stderr)
    cache = result_cache(args, out)
    print(f"planning {req.model_name} on {args.gpus} GPUs ...", file=sys.stderr)
    with open_executor(args.dask, args.workers) as pool:
        plan = run_plan(req, pool, cache)
    print(computed_line(cache, "engine run"), file=sys.stderr)
    written = write_plan(plan, out, plots=not args.no_plots)
    print("\n".join(plan_lines(plan)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    if args.write_scenario is not None:
        from simulator.search.chosen import write_scenario

        path = write_scenario(plan, args.write_scenario)
        print(f"wrote the chosen layout to {path} (clustersim run {path})")
    return 0
