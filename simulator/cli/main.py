"""``clustersim``: one console entry point with subcommands.

Example::

    clustersim run scenarios/gpt3-175b-1024.yaml --out out/gpt3
    clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --set parallel.zero=2 --method analytic

User errors (a bad scenario, an unknown preset, a bad flag) print one line per
problem on stderr and exit with status 2, without a traceback.

Building the parser imports nothing heavy: the simulator's commands import
their modules inside ``cmd_*``, and the calibration commands (:data:`LAZY_COMMANDS`)
are one help line each until one of them is the command being run (or its
``--help`` asked for); only then is its module imported and its ``add_parser``
called. ``clustersim --help`` and ``clustersim validate`` thus load no
calibration module, no torch, no matplotlib and no pandas; ``clustersim train``
(:mod:`simulator.job.train`) is registered the same way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from simulator import __version__
from simulator.errors import Problem, UserError

MAX_STEPS = 100_000  # --steps: each step is one simulation

if TYPE_CHECKING:
    from simulator.search.cache import ResultCache

# Subcommands that live in another package: name -> (module with ``add_parser(sub)``,
# the help line ``clustersim --help`` lists). A test checks each line against the
# one the module registers.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "calibrate": ("calibration.microbench.calibrate", "measure this machine (GEMM, "
                  "attention, memory, collectives) and write a hardware profile"),
    "measure": ("calibration.measured.measure", "train a small GPT with real TP/PP/DP "
                "under torchrun and record step times"),
    "compare": ("calibration.measured.compare", "simulate a measured run's scenario and "
                "compare with the measurement"),
    "host-cost": ("calibration.measured.host_cost", "time eager PyTorch's host cost per "
                  "kernel (the measured GPT at a degenerate size) and write it into a profile"),
    "validation": ("calibration.measured.validation", "measure fixed small configurations "
                   "and compare each with its simulation (the README's validation table)"),
    "train": ("simulator.job.train", "time, goodput, energy and cost to train N tokens, with "
              "failures and checkpoints"),
}

EXAMPLES = {
    "validate": "example:\n  clustersim validate scenarios/gpt3-175b-1024.yaml",
    "run": ("examples:\n  clustersim run scenarios/gpt3-175b-1024.yaml --out out/gpt3\n"
            "  clustersim run scenarios/gpt3-175b-1024.yaml --set parallel.schedule=gpipe "
            "--no-plots\n  clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --method analytic\n"
            "  clustersim run scenarios/gpt3-175b-1024.yaml --what-if --no-plots\n"
            "  clustersim run scenarios/llama2-7b-8gpu-ddp.yaml --set cluster.system=cpu.yaml "
            "--uncertainty 200 --seed 1 --method analytic"),
    "memory": "example:\n  clustersim memory scenarios/gpt3-175b-1024.yaml --set parallel.zero=1",
    "ops": ("examples:\n  clustersim ops scenarios/gpt3-175b-1024.yaml --set stack=megatron-2021\n"
            "  clustersim ops scenarios/llama2-7b-8gpu-fsdp.yaml --csv ops.csv"),
    "presets": "example:\n  clustersim presets",
    "schema": "example:\n  clustersim schema > scenario.schema.json",
    "plot": "example:\n  clustersim plot out/gpt3",
    "diff": ("examples:\n  clustersim run scenarios/gpt3-175b-1024.yaml --out out/1f1b\n"
             "  clustersim run scenarios/gpt3-175b-1024.yaml --set parallel.schedule=gpipe "
             "--out out/gpipe\n  clustersim diff out/1f1b out/gpipe --out out/1f1b-vs-gpipe"),
    "sweep": ("example:\n  clustersim sweep scenarios/gpt3-175b-1024.yaml --grid parallel.tp=4,8 "
              "--grid parallel.pp=8,16,32 --grid parallel.dp=auto "
              "--grid parallel.schedule=1f1b,interleaved --set parallel.virtual_stages=1\n"
              "  clustersim sweep scenarios/gpt3-175b-1024.yaml --grid parallel.pp=8,16 "
              "--grid training.micro_batch=1,2 --method engine --dask local:2 --out out/sw"),
    "plan": ("examples:\n  clustersim plan --model gpt3-175b --gpus 1024 --system dgx-a100-80gb "
             "--global-batch 1536\n  clustersim plan --model llama3-70b --gpus 512 --system "
             "dgx-h100 --global-batch 1024 --seq-len 8192 --dask local:2 --out out/llama\n"
             "  clustersim plan --model mixtral-8x7b --gpus 64 --system dgx-h100 "
             "--global-batch 256 --expert-parallel 2,4,8"),
}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``command`` (the subcommand being run) is the only one of
    :data:`LAZY_COMMANDS` whose module is imported to register its full options."""
    p = argparse.ArgumentParser(
        prog="clustersim", description="Discrete-event simulator of large-model training "
        "clusters.", epilog=EXAMPLES["run"], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clustersim {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def scenario_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("scenario", type=Path, help="scenario YAML file")
        q.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY.PATH=VALUE", help="override a scenario key (repeatable)")

    q = add("validate", "check a scenario; exit 0, or 2 with one line per problem")
    scenario_args(q)
    q.set_defaults(func=cmd_validate)
    q = add("run", "simulate one training step and write results.json and the timelines")
    scenario_args(q)
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/<scenario name>)")
    q.add_argument("--method", choices=["engine", "analytic"], default=None,
                   help="discrete-event engine (default) or closed-form estimate")
    q.add_argument("--fidelity", choices=["folded", "full"], default=None,
                   help="folded: one rank per class of identical ranks stands for its "
                   "peers (one per stage when the cluster is symmetric; default); full: all")
    q.add_argument("--no-plots", action="store_true", help="skip the PNGs (faster)")
    q.add_argument("--what-if", action="store_true", help="also re-simulate with each cost "
                   "class (GEMM, attention, memory-bound, each link class) 10%% faster and "
                   "print what bounds the step (results.json: what_if)")
    q.add_argument("--steps", type=_positive_int, default=1, metavar="N",
                   help="simulate N consecutive steps with fresh jitter (variability.jitter) "
                        "and report the step-time distribution (p50, p95, p99, max) and the "
                        "wait for the slowest rank (engine)")
    q.add_argument("--uncertainty", default=None, metavar="N",
                   help="also simulate N samples of the hardware profile's fitted terms, "
                   "each scaled by a lognormal factor with the profile's relative spread "
                   "(its uncertainty section, written by calibrate), and report step time "
                   "and MFU as p5/p50/p95 (results.json: uncertainty, step_time_s_p5 ...)")
    q.add_argument("--seed", default="0", metavar="S",
                   help="seed of the --uncertainty samples (default 0)")
    q.add_argument("--max-tasks", type=_positive_int, default=None, metavar="N",
                   help="refuse engine runs estimated above N tasks (default 2.5e7, about "
                   "40 GB); checked before building")
    q.add_argument("--timeline", choices=["parquet", "csv", "both"], default="parquet",
                   help="span table format: timeline.parquet (default), timeline.csv, or both")
    q.add_argument("--trace-ranks", default="stages", metavar="all|stages|R,R,...",
                   help="ranks in trace.json: stages (default: each pipeline stage's lowest "
                   "rank), all, or a list such as 0,5,17")
    q.set_defaults(func=cmd_run)
    q = add("memory", "per-rank memory table and out-of-memory verdict")
    scenario_args(q)
    q.set_defaults(func=cmd_memory)
    q = add("ops", "one layer's kernel-level ops under the scenario's stack: time, bound, share")
    scenario_args(q)
    q.add_argument("--csv", metavar="FILE", help="also write the table as CSV to FILE")
    q.set_defaults(func=cmd_ops)
    q = add("presets", "list bundled models and systems")
    q.set_defaults(func=cmd_presets)
    q = add("schema", "print the scenario JSON Schema (for editors)")
    q.set_defaults(func=cmd_schema)
    q = add("sweep", "evaluate a grid of overrides of one scenario; table and best points")
    scenario_args(q)
    q.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2,...",
                   help="an axis of the grid (repeatable); parallel.dp=auto fills dp in")
    q.add_argument("--method", choices=["analytic", "engine"], default="analytic",
                   help="analytic (default, milliseconds a point) or the engine")
    q.add_argument("--out", type=Path, default=None, help="write sweep.csv, sweep.parquet, "
                   "sweep.json and heatmap.png here")
    _search_args(q)
    q.set_defaults(func=cmd_sweep)
    _add_plan(add("plan", "search every layout of a model on N GPUs: plan.csv, pareto.png and "
                  "the fastest layout that fits"))
    q = add("plot", "re-draw the PNGs of a run, sweep (heatmap), plan (Pareto) or train directory")
    q.add_argument("run_dir", type=Path)
    q.add_argument("--axes", default=None, metavar="X,Y",
                   help="sweep heatmap axes (default: the first two swept keys)")
    q.set_defaults(func=cmd_plot)
    q = add("diff", "compare two run directories: step time, every category of the step "
            "breakdown and peak memory, with deltas; diff.json and a waterfall diff.png")
    q.add_argument("run_a", type=Path, metavar="RUN_A", help="run directory (results.json)")
    q.add_argument("run_b", type=Path, metavar="RUN_B", help="run directory (results.json)")
    q.add_argument("--out", type=Path, default=None, help="where to write diff.json and "
                   "diff.png (default out/diff-<A>-vs-<B>)")
    q.add_argument("--no-plots", action="store_true", help="skip diff.png")
    q.set_defaults(func=cmd_diff)
    for name, (module, help_) in LAZY_COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:  # listed in `clustersim --help`; never parses (only the command run does)
            sub.add_parser(name, help=help_)
    return p


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first word that is not an option (the
    top-level options, --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _search_args(q: argparse.ArgumentParser) -> None:
    """Where a search runs and what it remembers (sweep and plan)."""
    q.add_argument("--workers", type=int, default=None, help="local processes (default: cores)")
    q.add_argument("--dask", default=None, metavar="local:W|tcp://HOST:8786",
                   help="run on a Dask cluster: W local workers, or an existing scheduler")
    q.add_argument("--cache", type=Path, default=None, metavar="DIR", help="result cache "
                   "(default OUT/cache, or ~/.cache/clustersim without --out)")
    q.add_argument("--no-cache", action="store_true", help="compute every point again")
    q.add_argument("--no-plots", action="store_true", help="skip the PNG")


def _add_plan(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", required=True, help="model preset (clustersim presets)")
    q.add_argument("--gpus", type=int, required=True, help="N, GPUs in all")
    q.add_argument("--system", required=True, help="system preset or hardware-profile YAML")
    q.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    q.add_argument("--seq-len", type=int, default=None, help="default: the model preset's")
    q.add_argument("--top", type=int, default=5,
                   help="re-simulate the K best with the engine (and the best of each ZeRO "
                   "stage and CP degree besides; 0: none)")
    q.add_argument("--micro-batches", default="1,2,4,8,16", metavar="B1,B2,...",
                   help="micro-batch sizes to try")
    q.add_argument("--context-parallel", default=None, metavar="C1,C2,...",
                   help="CP degrees to try (default: 1, and powers of two while each CP rank "
                   "keeps >= 4096 tokens; 1 for a mixture of experts)")
    q.add_argument("--expert-parallel", default=None, metavar="E1,E2,...",
                   help="EP degrees to try, a mixture of experts only (default: every divisor "
                   "of the experts that divides a stage's cp * dp)")
    q.add_argument("--tp-beyond-node", action="store_true",
                   help="also try TP groups larger than a node")
    q.add_argument("--out", type=Path, default=None, help="output directory "
                   "(default out/plan-<model>-<gpus>)")
    _search_args(q)
    q.set_defaults(func=cmd_plan)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``2e7`` and ``20_000_000`` are accepted)."""
    try:
        value = float(text) if "e" in text.lower() else int(text)
        whole = value == int(value) and value >= 1
    except (ValueError, OverflowError):
        whole = False
    if not whole:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(value)


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from simulator.spec.scenario import load_scenario, scenario_warnings

    s = load_scenario(args.scenario, args.overrides)
    for line in scenario_warnings(s):
        print(line, file=sys.stderr)
    return s


def cmd_validate(args: argparse.Namespace) -> int:
    from simulator.builder.budget import DEFAULT_MAX_TASKS, engine_cost

    s = _load(args)
    cost = engine_cost(s, s.simulation.fidelity)
    if cost.tasks > DEFAULT_MAX_TASKS:
        print(f"warning: an engine run would build about {cost.tasks:.2g} tasks "
              f"(~{cost.memory_bytes / 1e9:.3g} GB), above the default limit; `run` will ask "
              "for --method analytic or --max-tasks", file=sys.stderr)
    par = s.parallel
    extra = "".join(f" · {name} {deg}" for name, deg in (("cp", par.cp), ("ep", par.ep))
                    if deg > 1)
    print(f"{args.scenario}: ok ({s.name}: {par.world} GPUs, tp {par.tp} · "
          f"pp {par.pp} · dp {par.dp}{extra}, {par.schedule}, m = {s.microbatches})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from simulator.outputs.rank_selection import parse_rank_selection
    from simulator.outputs.run_dir import check_out_dir, default_out_dir, staged_run

    samples, seed = None, 0
    if args.uncertainty is not None:  # a bad flag fails before the scenario is read
        from simulator.analysis.uncertainty import parse_samples, parse_seed

        samples, seed = parse_samples(args.uncertainty), parse_seed(args.seed)
    s = _load(args)
    trace_ranks = parse_rank_selection(args.trace_ranks)
    out = args.out or default_out_dir(s.name)
    check_out_dir(out)  # before simulating: a bad --out is one line, not a lost run
    if args.steps > MAX_STEPS:
        raise UserError([Problem("--steps", args.steps, f"at most {MAX_STEPS:,} steps (each is "
                                 "a simulation); sample fewer")])
    if args.steps > 1 and (args.method or s.simulation.method) != "engine":
        raise UserError([Problem("--steps", args.steps, "many steps need the engine (the "
                                 "analytic method has no jitter); drop --method analytic")])
    if (args.method or s.simulation.method) == "engine":
        from simulator.builder.budget import check_engine_cost

        check_engine_cost(s, args.fidelity or s.simulation.fidelity, args.max_tasks)
    from simulator.analysis.report import summary_lines
    from simulator.api import run_scenario, write_outputs  # pandas: after the checks

    print(f"simulating {s.name} ({s.parallel.world} GPUs) ...", file=sys.stderr)
    run = run_scenario(s, args.method, args.fidelity, progress=True, trace_ranks=trace_ranks,
                       max_tasks=args.max_tasks)
    results, spans = run.results, run.spans
    if args.steps > 1 and results["method"] == "engine":
        from simulator.analysis.steps import many_steps

        results["steps"] = many_steps(s, args.steps, results, args.fidelity)
    if samples is not None:
        from simulator.analysis.uncertainty import flat_keys, monte_carlo, print_start

        print_start(samples, s.hardware)
        results["uncertainty"] = monte_carlo(s, samples, seed, results)
        results.update(flat_keys(results["uncertainty"]))
    if args.what_if:
        from simulator.analysis.whatif import CLASS_LABELS, what_if, what_if_lines

        def say(name: str) -> None:
            print(f"what-if: {CLASS_LABELS[name]} 10% faster ...", file=sys.stderr, flush=True)

        results["what_if"] = what_if(s, results["step_time_s"], results["method"],
                                     results.get("fidelity"), say)
    with staged_run(out) as staging:
        written = write_outputs(staging, results, spans, plots=not args.no_plots,
                                timeline=args.timeline, trace=run.trace)
    print("\n".join(summary_lines(results)))
    if "steps" in results:
        from simulator.analysis.steps import summary_lines as steps_lines

        print("\n".join(steps_lines(results["steps"])))
    if samples is not None:
        from simulator.analysis.uncertainty import summary_lines as uncertainty_lines

        print("\n".join(uncertainty_lines(results["uncertainty"])))
    if args.what_if:
        print("\n".join(what_if_lines(results["what_if"])))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from simulator.builder.budget import check_stages
    from simulator.model.memory import memory_report

    s = _load(args)
    check_stages(s)
    gb = 1e9
    cols = ("stage", "weights", "grads", "optimizer", "activations", "logits", "buffers",
            "total", "fits")
    print(f"{s.name}: per-GPU memory in GB (capacity {s.hardware.gpu.memory_GB:g} GB, "
          f"ZeRO-{s.parallel.zero}, {s.parallel.schedule}, recompute {s.parallel.recompute})")
    print("  ".join(f"{c:>11}" for c in cols))
    for m in memory_report(s):
        vals = (m.weights, m.gradients, m.optimizer, m.activations, m.logits, m.comm_buffers,
                m.total)
        print("  ".join([f"{m.stage:>11}", *(f"{v / gb:>11.2f}" for v in vals),
                         f"{'yes' if m.fits else 'NO':>11}"]))
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from simulator.outputs.ops_table import format_table, op_rows, to_csv
    from simulator.outputs.trace_export import atomic_output

    s = _load(args)
    rows = op_rows(s)
    print(format_table(s, rows))
    if args.csv:
        with atomic_output(args.csv) as tmp:
            tmp.write_text(to_csv(rows), encoding="utf-8")
        print(f"wrote {args.csv}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from simulator.model import transformer as mdl
    from simulator.spec.scenario import load_preset_model, preset_model_names
    from simulator.system.hardware import load_system, preset_system_names

    print("models:")
    for name in preset_model_names():
        spec = load_preset_model(name)
        moe = (f" experts={spec.experts} top-{spec.experts_per_token}, "
               f"{mdl.active_param_count(spec) / 1e9:.2f} B active "
               f"({mdl.active_param_count(spec, embedding=False) / 1e9:.2f} B without the "
               "input embedding)") if spec.is_moe else ""
        print(f"  {name:<14} {mdl.param_count(spec) / 1e9:8.2f} B params  l={spec.layers} "
              f"h={spec.hidden} a={spec.heads} kv={spec.kv} ffn={spec.ffn} V={spec.vocab} "
              f"s={spec.seq_len}{moe}")
    print("systems:")
    for name in preset_system_names():
        hw = load_system(name)
        bf16 = hw.gpu.peak_tflops.get("bf16", 0.0)
        print(f"  {name:<14} {hw.gpus_per_node} x {hw.gpu.name}: {bf16:g} TFLOP/s bf16, "
              f"{hw.gpu.memory_GB:g} GB, NVLink {hw.intra_node.bandwidth_GBps:g} GB/s, "
              f"NIC {hw.inter_node.bandwidth_GBps:g} GB/s per GPU")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from simulator.spec.scenario import Scenario

    print(json.dumps(Scenario.model_json_schema(), indent=2))
    return 0


def _cache(args: argparse.Namespace, out: Path | None) -> ResultCache | None:
    from simulator.search.cache import ResultCache

    if args.no_cache:
        return None
    default = out / "cache" if out else Path("~/.cache/clustersim")
    return ResultCache(args.cache or default)


def _computed_line(cache: ResultCache | None, what: str) -> str:
    if cache is None:
        return f"cache off: every {what} computed"
    return f"{cache.stored} {what}(s) computed, {cache.hits} from the cache ({cache.root})"


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import check_out_dir
    from simulator.search.executors import open_executor
    from simulator.search.sweep import best, parse_grid, run_sweep, write_sweep

    _load(args)  # the base scenario must validate before its points are tried
    if args.out:
        check_out_dir(args.out)
    axes = parse_grid(args.grid)
    n = 1
    for values in axes.values():
        n *= len(values)
    print(f"sweeping {n} point(s) ({args.method}) ...", file=sys.stderr)
    cache = _cache(args, args.out)
    with open_executor(args.dask, args.workers) as pool:
        table = run_sweep(args.scenario, axes, args.overrides, args.method, pool, cache)
    print(_computed_line(cache, "point"), file=sys.stderr)
    if args.out:
        meta = {"scenario": str(args.scenario), "axes": list(axes), "sets": args.overrides,
                "method": args.method}
        written = write_sweep(table, args.out, meta, plots=not args.no_plots)
        print(f"wrote {', '.join(p.name for p in written)} to {args.out}/")
    invalid = int((table["error"] != "").sum()) if "error" in table else 0
    top = best(table)
    print(f"{len(table) - invalid} valid point(s), {invalid} invalid; fastest that fit:")
    cols = [*axes, "tp", "pp", "dp", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction"]
    print(top[[c for c in dict.fromkeys(cols) if c in top]].to_string(index=False)
          if len(top) else "  none fits")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import check_out_dir, default_out_dir
    from simulator.search.executors import open_executor
    from simulator.search.plan import PlanRequest, plan_lines, run_plan, write_plan

    cp, ep = (None if text is None else _int_list(flag, text) for flag, text in
              (("--context-parallel", args.context_parallel),
               ("--expert-parallel", args.expert_parallel)))
    req = PlanRequest(args.model, args.gpus, args.system, args.global_batch, args.seq_len,
                      args.top, _int_list("--micro-batches", args.micro_batches),
                      context_parallel=cp, expert_parallel=ep,
                      tp_beyond_node=args.tp_beyond_node)
    out = args.out or default_out_dir(f"plan-{args.model}-{args.gpus}")
    check_out_dir(out)
    cache = _cache(args, out)
    print(f"planning {args.model} on {args.gpus} GPUs ...", file=sys.stderr)
    with open_executor(args.dask, args.workers) as pool:
        plan = run_plan(req, pool, cache)
    print(_computed_line(cache, "engine run"), file=sys.stderr)
    written = write_plan(plan, out, plots=not args.no_plots)
    print("\n".join(plan_lines(plan)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    """``1,2,4`` as (1, 2, 4)."""
    values = tuple(int(v) for v in text.split(",") if v.strip().isdigit())
    if not values or min(values) < 1 or len(values) != len(text.split(",")):
        raise UserError([Problem(flag, text, "expected positive whole numbers separated by "
                                 "commas, e.g. 1,2,4")])
    return values


def cmd_plot(args: argparse.Namespace) -> int:
    from simulator.outputs.run_dir import MANIFEST, check_run_dir, write_manifest

    if (args.run_dir / "plan.csv").is_file():
        from simulator.outputs.plots.search import plot_pareto

        print(plot_pareto(args.run_dir))
        return 0
    if (args.run_dir / "train.json").is_file():
        from simulator.outputs.plots.job import plot_training

        print(plot_training(args.run_dir))
        return 0
    if (args.run_dir / "sweep.csv").is_file():
        from simulator.outputs.plots.search import plot_heatmap

        axes = args.axes.split(",") if args.axes else None
        print(plot_heatmap(args.run_dir, axes))
        return 0
    manifest = check_run_dir(args.run_dir)  # every file of one complete run, or one line
    from simulator.outputs.plots.figures import plot_all  # matplotlib: after the checks

    written = plot_all(args.run_dir)
    names = sorted({*manifest["files"], *(p.name for p in written)})
    write_manifest(args.run_dir, [n for n in names if n != MANIFEST], manifest.get("run_id"))
    for path in written:
        print(path)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from simulator.outputs.diff import diff_lines, load_run, run_diff, write_diff

    a, b = load_run(args.run_a, "RUN_A"), load_run(args.run_b, "RUN_B")
    diff = run_diff(a, b, args.run_a, args.run_b)
    out = args.out or Path("out") / f"diff-{args.run_a.resolve().name}-vs-" \
        f"{args.run_b.resolve().name}"
    written = write_diff(out, diff, plot=not args.no_plots)
    print("\n".join(diff_lines(diff)))
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(_command(argv)).parse_args(argv)
    try:
        return int(args.func(args))
    except UserError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`clustersim diff A B | head`): stop quietly, and keep
        # Python from reporting the pipe again when it flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
