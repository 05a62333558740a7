"""A pydantic validation error as one line: the field, the value and the fix.

Strict validation words an error by its kind (a whole number written otherwise, a
number out of range, an unknown key with the closest valid one); every reader of a
scenario or of a section of it (:mod:`simulator.spec.load`, a strategy's options in
:mod:`simulator.spec.rules`) turns its errors into problems here.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

from simulator.errors import Problem
from simulator.spec.base import MAX_STAGES
from simulator.spec.scenario import Scenario

_WHOLE = "must be a whole number written in decimal, e.g. 128 (not true, \"8\", 0x80, 1_28, 128.0)"


_FIXES = {
    "missing": "required; add it",
    "int_type": _WHOLE,
    "int_parsing": _WHOLE,
    "int_from_float": _WHOLE,
    "float_type": "must be a number, e.g. 25 or 2.5e+1 (not true or a quoted string)",
    "float_parsing": "must be a number, e.g. 25 or 2.5e+1",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be text; quote it if it looks like a number, date or true/false",
    "dict_type": "must be a mapping of keys",
    "model_type": "must be a mapping of keys",
    "model_attributes_type": "must be a mapping of keys",
    "tuple_type": "must be a list, e.g. [7, 8, 8, 7]",
    "too_long": f"has too many entries: at most {MAX_STAGES:,}, one per pipeline stage",
}


def problem_of(err: Any, prefix: tuple[str, ...] = (),
               root: type[BaseModel] | None = None) -> Problem:
    """One pydantic error as a problem naming the field, the value and the fix; the
    field under ``prefix`` when ``root`` (default the scenario) was validated there."""
    loc = [str(x) for x in err["loc"]]
    field = ".".join([*prefix, *loc]) or "scenario"
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return Problem(field, value, _unknown_key_fix(loc, root or Scenario))
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than_equal": "<=",
              "less_than": "<"}[kind]
        bound = next(iter(err.get("ctx", {}).values()), "")
        return Problem(field, value, f"must be {op} {bound}")
    if kind in ("literal_error", "enum"):
        return Problem(field, value, f"must be one of {err['ctx']['expected']}")
    if kind == "value_error":
        msg = str(err["msg"]).removeprefix("Value error, ")
        return Problem(field, value, msg)
    return Problem(field, value, _FIXES.get(kind, str(err["msg"])))


def _section_fields(loc: list[str], root: type[BaseModel]) -> list[str]:
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        # an optional section (``mla: MLASpec | None``) names its model among the args
        ann = next((a for a in (ann, *typing.get_args(ann))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if ann is None:
            return []
        model = ann
    return list(model.model_fields)


#: What other tools call a key (Megatron-LM's and Hugging Face's arguments, common
#: shorthand) -> the key of the section that means it, suggested when it is unknown there.
OTHER_NAMES = {
    "tensor": "tp", "tensor_parallel": "tp", "tensor_model_parallel_size": "tp",
    "pipeline": "pp", "pipeline_parallel": "pp", "pipeline_model_parallel_size": "pp",
    "data": "dp", "data_parallel": "dp", "data_parallel_size": "dp",
    "context": "cp", "context_parallel": "cp", "context_parallel_size": "cp",
    "expert": "ep", "expert_parallel": "ep", "expert_model_parallel_size": "ep",
    "zero_stage": "zero", "sp": "sequence_parallel",
    "activation_checkpointing": "recompute", "gradient_checkpointing": "recompute",
    "recompute_granularity": "recompute", "selective_ac_option": "recompute_every",
    "ac_freq": "recompute_every", "virtual_pipeline_model_parallel_size":
    "virtual_stages", "micro_batch_size": "micro_batch", "global_batch_size": "global_batch",
    "precision": "dtype", "num_layers": "layers", "n_layers": "layers",
    "num_hidden_layers": "layers", "hidden_size": "hidden", "d_model": "hidden",
    "num_attention_heads": "heads", "n_heads": "heads", "num_key_value_heads": "kv_heads",
    "num_query_groups": "kv_heads", "ffn_hidden_size": "ffn_hidden",
    "intermediate_size": "ffn_hidden", "vocab_size": "vocab", "seq_length": "seq_len",
    "max_position_embeddings": "seq_len", "num_experts": "experts",
    "moe_router_topk": "experts_per_token", "num_nodes": "nodes", "gpu": "system",
}


def _unknown_key_fix(loc: list[str], root: type[BaseModel]) -> str:
    valid = _section_fields(loc, root)
    other = OTHER_NAMES.get(loc[-1])
    near = [other] if other in valid else difflib.get_close_matches(loc[-1], valid, n=1,
                                                                      cutoff=0.5)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def key_problem(key: str, flag: str, root: type[BaseModel] = Scenario) -> Problem | None:
    """A problem when the dotted ``key`` names no field of the schema (an unknown part,
    with the closest valid one), else None: the check a grid axis gets before its
    points are tried. Below a field that is not a section (a mapping such as
    ``strategies``) any key is accepted; the point's own validation judges it."""
    parts = key.split(".")
    model = root
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return Problem(flag, key, _unknown_key_fix(parts[: i + 1], root))
        ann = field.annotation
        section = next((a for a in (ann, *typing.get_args(ann))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is None:
            return None
        model = section
    return None
