"""Rules across the sections of a scenario: each problem names the field, the value
and the fix. What validates but has no workload yet, and legal but probably unintended
choices (warnings), are here too.

The rules of one parallelism are its strategy's (:mod:`simulator.strategies.registry`:
each strategy's ``problems``, ``unsupported`` and ``warnings``); here are the rules of
the model and the cluster, a new strategy's own section (``strategies.<name>``,
validated by its options model) and the variability.
"""

from __future__ import annotations

from pydantic import ValidationError

from simulator.errors import Problem
from simulator.spec.model_spec import ModelSpec
from simulator.spec.problems import problem_of
from simulator.spec.recompute import model_problems, recompute_problems
from simulator.spec.scenario import Scenario
from simulator.spec.variability import variability_problems
from simulator.strategies import registry
from simulator.system.hardware import GPUSpec


def consistency_problems(s: Scenario) -> list[Problem]:
    """Rules across sections; each problem names the field, the value and the fix."""
    par, mdl = s.parallel, s.model
    out: list[Problem] = []
    if s.cluster.gpus != par.world:
        out.append(Problem("parallel", f"tp({par.tp}) * cp({par.cp}) * pp({par.pp}) * "
                           f"dp({par.dp}) = {par.world}",
                           f"must equal cluster.nodes({s.cluster.nodes}) * gpus_per_node"
                           f"({s.cluster.gpus_per_node}) = {s.cluster.gpus}; change the degrees "
                           "or the cluster size"))
    out += domain_problems(s)
    if mdl.kv > mdl.heads or mdl.heads % mdl.kv:
        out.append(Problem("model.kv_heads", mdl.kv, f"must divide model.heads ({mdl.heads}): "
                           "each KV head serves a whole group of query heads"))
    if mdl.head_dim is None:
        out.append(Problem("model.hidden", mdl.hidden, f"not divisible by model.heads "
                           f"({mdl.heads}); head size must be whole: set model.head_dim "
                           "where each head's width is not hidden / heads"))
    if par.fsdp is not None and par.fsdp != (par.zero == 3):
        out.append(Problem("parallel.fsdp", par.fsdp, f"contradicts parallel.zero = {par.zero} "
                           "(fsdp: true means zero: 3, false a zero below 3); remove fsdp "
                           "and keep zero"))
    out += recompute_problems(par) + model_problems(mdl, par, s.stack.fp8)
    options = options_problems(s)
    if options:  # a strategy's rules read its options: they must be valid first
        return out + options
    for strategy in registry.strategies():
        out += strategy.problems(s)
    return out + moe_problems(mdl) + variability_problems(s.variability, par.world, par.pp) \
        + fp8_problems(s) + state_dtype_problems(s)


def state_dtype_problems(s: Scenario) -> list[Problem]:
    """The optimizer's master-weight storage and FP8 activation caching need what they
    store: int16 remainders a bf16 parameter with an fp32 master beside it (Transformer
    Engine's FusedAdam keeps them "only when param type is BF16 and master weight type is
    FP32"), an fp16 master a 16-bit parameter that is not itself the master, DeepSeek-V3's
    caching FP8 linears."""
    st, dtype = s.stack, s.training.dtype
    master = dtype != "fp32" and not st.fp32_params(2)
    out: list[Problem] = []
    if st.param_remainders and (dtype != "bf16" or not master or st.main_params_dtype != "fp32"):
        out.append(Problem("stack.param_remainders", True, "needs bf16 parameters with fp32 "
                           "master weights beside them (training.dtype: bf16, "
                           "stack.main_params_dtype: fp32, master_weights: optimizer, no "
                           "autocast); set it false"))
    if st.main_params_dtype != "fp32" and not master:
        out.append(Problem("stack.main_params_dtype", st.main_params_dtype, "the parameters "
                           f"are the fp32 master here (training.dtype {dtype}, "
                           f"master_weights {st.master_weights}, autocast {st.autocast}); "
                           "remove it or train in 16 bits with master_weights: optimizer"))
    if st.fp8_cache != "linear_inputs" and st.fp8 == "none":
        out.append(Problem("stack.fp8_cache", st.fp8_cache, "caches the inputs of FP8 "
                           "linears: set stack.fp8 (DeepSeek-V3's recipe is blockwise) or "
                           "remove it"))
    return out


def fp8_problems(s: Scenario) -> list[Problem]:
    """FP8 linears (``stack.fp8``) need FP8 tensor cores for the recipe on every system
    the scenario runs on (``gpu.fp8_recipes``)."""
    if s.stack.fp8 == "none":
        return []
    systems = {str(s.cluster.system): s.hardware}
    systems.update({str(e.system): s.hardware_of_stage(e.stages[0])
                    for e in s.variability.stage_systems if e.stages})
    lacking = [(name, hw) for name, hw in systems.items()
               if s.stack.fp8 not in hw.gpu.fp8_recipes or "fp8" not in hw.gpu.peak_tflops]
    if not lacking:
        return []
    name, hw = lacking[0]
    problem = fp8_problem(hw.gpu, s.stack.fp8, name, _systems_with(s.stack.fp8))
    return [problem] if problem is not None else []


def _systems_with(recipe: str) -> list[str]:
    """The bundled system presets whose GPU runs FP8 ``recipe``."""
    from simulator.system.profiles import load_system, preset_system_names

    return [name for name in preset_system_names()
            if recipe in (gpu := load_system(name).gpu).fp8_recipes and "fp8" in gpu.peak_tflops]


def domain_problems(s: Scenario) -> list[Problem]:
    """An NVLink domain holds whole nodes: a scenario's GPUs per node must divide it."""
    domain = s.hardware.nvlink_domain_gpus
    gpn = s.cluster.gpus_per_node or 1
    if domain is None or domain % gpn == 0:
        return []
    return [Problem("cluster.gpus_per_node", gpn, f"does not divide {s.cluster.system}'s "
                    f"NVLink domain ({domain} GPUs), which holds whole nodes; use a divisor "
                    f"of {domain}")]


def options_problems(s: Scenario) -> list[Problem]:
    """Each ``strategies.<name>`` section against its strategy's options model: an unknown
    strategy, a strategy without options, and every problem of the section's fields."""
    known = {st.name: st for st in registry.strategies() if st.options is not None}
    out: list[Problem] = []
    for name, section in s.strategies.items():
        strategy = known.get(name)
        if strategy is None:
            out.append(Problem(f"strategies.{name}", "set", "unknown strategy or one without "
                               f"options; with options: {', '.join(known) or 'none'}"))
            continue
        assert strategy.options is not None
        try:
            strategy.options.model_validate(section, strict=True)
        except ValidationError as exc:
            out += [problem_of(err, ("strategies", name), strategy.options)
                    for err in exc.errors()]
    return out


def moe_problems(mdl: ModelSpec) -> list[Problem]:
    """The mixture-of-experts and latent-attention fields of a model, among themselves."""
    out: list[Problem] = []
    if not mdl.is_moe:
        dense_defaults = {"experts_per_token": 1, "shared_experts": 0, "first_dense_layers": 0,
                          "moe_layer_freq": 1, "capacity_factor": None, "router_skew": None}
        for name, default in dense_defaults.items():
            if getattr(mdl, name) != default:
                out.append(Problem(f"model.{name}", getattr(mdl, name), "only for a mixture of "
                                   "experts (model.experts = 0); set model.experts or remove it"))
    else:
        if mdl.experts_per_token > mdl.experts:
            out.append(Problem("model.experts_per_token", mdl.experts_per_token,
                               f"more than model.experts ({mdl.experts}); use at most "
                               f"{mdl.experts}"))
        if mdl.first_dense_layers >= mdl.layers:
            out.append(Problem("model.first_dense_layers", mdl.first_dense_layers,
                               f"leaves no MoE layer among model.layers ({mdl.layers}); use "
                               f"fewer than {mdl.layers}"))
    if mdl.mla is not None and mdl.kv != mdl.heads:
        out.append(Problem("model.kv_heads", mdl.kv, f"latent attention (model.mla) gives every "
                           f"head its own key and value; set kv_heads = heads ({mdl.heads}) or "
                           "leave it out"))
    return out


def not_yet_simulated(s: Scenario) -> list[Problem]:
    """What validates and has a memory model but no workload yet: latent attention in a
    dense model, and what each strategy's pass does not build (context parallelism with
    experts or latent attention, the combinations of a mixture of experts that the
    expert pass does not build, TP communication overlap with either of those)."""
    mdl = s.model
    out: list[Problem] = []
    if mdl.mla is not None and not mdl.is_moe:
        out.append(Problem("model.mla", "set", "not yet simulated: latent attention has "
                           "parameter, FLOP and memory arithmetic (clustersim memory), but run "
                           "needs its workload ops; use a model without mla"))
    for strategy in registry.strategies():
        out += strategy.unsupported(s)
    return out


#: Tokens a step beyond any published training run's. The largest we know of ramps to
#: 15,360 sequences of 4,096 tokens (62.9M; DeepSeek-V3 technical report, §4.2); Llama 3
#: 405B ran 16M. A step above 64 Mi tokens almost always means a batch given in tokens
#: where ``training.global_batch`` counts sequences.
MAX_PLAUSIBLE_TOKENS = 64 * 2**20


def batch_warning(global_batch: int, seq_len: int, field: str = "training.global_batch"
                  ) -> list[str]:
    """A warning when ``global_batch`` sequences of ``seq_len`` tokens exceed
    :data:`MAX_PLAUSIBLE_TOKENS` a step, with the batch it probably meant."""
    tokens = global_batch * seq_len
    if tokens <= MAX_PLAUSIBLE_TOKENS:
        return []
    meant = max(1, round(global_batch / seq_len))
    return [f"warning: {field} = {global_batch:,} sequences × {seq_len:,} tokens = "
            f"{tokens:.3g} tokens a step, more than any published training run used (above "
            f"{MAX_PLAUSIBLE_TOKENS / 2**20:.0f}M); {field} counts sequences, not tokens: "
            f"for {global_batch:,} tokens a step use {meant:,} sequences"]


def scenario_warnings(s: Scenario) -> list[str]:
    """Legal but probably unintended choices: an implausible batch, another name read
    as the one the schema uses, then each strategy's."""
    out = batch_warning(s.training.global_batch, s.model.seq_len)
    if s.parallel.fsdp:
        out.append("warning: parallel.fsdp = true: read as parallel.zero: 3 (ZeRO-3, FSDP's "
                   "full sharding of parameters, gradients and optimizer states); write zero: 3")
    if s.stack.fp8 != "none" and s.model.is_moe:
        kept = "its router" + (" and shared experts" if s.model.shared_experts else "")
        out.append(f"warning: stack.fp8 = {s.stack.fp8}: FP8 covers the attention's (standard "
                   f"or latent), the dense MLP's and the routed experts' projections only; "
                   f"{kept}, run in "
                   f"{s.training.dtype} (docs/model.md, FP8 linears)")
    for strategy in registry.strategies():
        out += strategy.warnings(s)
    return out

def fp8_problem(gpu: GPUSpec, recipe: str, system: str, runs_it: list[str]) -> Problem | None:
    """Why ``gpu`` cannot run FP8 ``recipe`` (None when it can): no fp8 peak, or a recipe
    outside its ``fp8_recipes``; ``runs_it`` names the systems that do."""
    if "fp8" in gpu.peak_tflops and recipe in gpu.fp8_recipes:
        return None
    has = (f"its FP8 recipes are {', '.join(gpu.fp8_recipes)}; choose one of those, "
           if gpu.fp8_recipes else "choose ")
    return Problem("stack.fp8", recipe, f"system {system} ({gpu.name}) has no FP8 "
                   f"tensor cores for it: {has}a system that runs {recipe} "
                   f"({', '.join(runs_it)}), or stack.fp8: none")
