"""What every importer shares: a draft scenario filled field by field, the list of what
could not be mapped, the cluster and model sections, and the YAML written at the end.

An importer reads a framework's own configuration (Megatron-LM's launch arguments,
torchtitan's TOML) and fills a :class:`Draft`: each scenario field it can set, and a
:class:`Note` for each setting that has no field in the scenario schema, with the
reason. Nothing is dropped silently: the notes are printed and written as a comment
block at the top of the scenario. Settings that do not bear on a simulated step
(paths, logging, the tokenizer's files) are classed as ignored by design in each
importer's tables and are not listed.

The draft is validated as any scenario is (:func:`simulator.spec.load.scenario_from_dict`)
before anything is written, and the file is written atomically.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simulator.errors import Problem, ScenarioError, UserError


@dataclass(frozen=True)
class Note:
    """A setting of the source that the scenario does not express."""

    source: str  # the flag or dotted key, as the source spells it
    value: str  # its value, as given
    reason: str  # why it has no field, and what the scenario simulates instead

    def line(self) -> str:
        value = f" {self.value}" if self.value else ""
        return f"{self.source}{value}: {self.reason}"


@dataclass
class Draft:
    """A scenario under construction: nested sections and the notes."""

    data: dict[str, Any] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)

    def set(self, path: str, value: Any) -> None:
        """Set a dotted field (``parallel.tp``)."""
        *parents, last = path.split(".")
        node = self.data
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def note(self, source: str, value: object, reason: str) -> None:
        text = value if isinstance(value, str) else " ".join(map(str, value)) \
            if isinstance(value, (list, tuple)) else str(value)
        self.notes.append(Note(source, text, reason))


def layout(draft: Draft, system: str, nodes: int | None, gpus: int | None,
           what: str) -> None:
    """The cluster section and ``parallel.dp``: from ``nodes`` or ``gpus`` (one of them
    given: the source does not say), each GPU count checked against tp · cp · pp."""
    from simulator.system.profiles import load_system

    per_node = load_system(system).gpus_per_node
    if nodes is None and gpus is None:
        raise UserError([Problem(what, "no GPU count", "the configuration does not say how "
                                 "many GPUs run it; pass --nodes N or --gpus N")])
    if gpus is None:
        assert nodes is not None
        gpus = nodes * per_node
    elif nodes is None:
        if gpus % per_node and gpus > per_node:
            raise UserError([Problem("--gpus", gpus, f"not a whole number of {system} nodes "
                                     f"({per_node} GPUs each); use a multiple of {per_node}")])
        nodes = max(1, gpus // per_node)
    draft.set("cluster", {"system": system, "nodes": nodes})
    if gpus < per_node:
        draft.set("cluster.gpus_per_node", gpus)
    tp, cp, pp = (int(draft.get(f"parallel.{k}", 1)) for k in ("tp", "cp", "pp"))
    if gpus % (tp * cp * pp):
        raise UserError([Problem("parallel", f"tp({tp}) * cp({cp}) * pp({pp}) = {tp * cp * pp}",
                                 f"does not divide the {gpus} GPUs; change the degrees or "
                                 "--nodes/--gpus")])
    draft.set("parallel.dp", gpus // (tp * cp * pp))


def model_section(fields: dict[str, Any]) -> dict[str, Any]:
    """The model as a bundled preset when its architecture is one (only ``seq_len``
    written beside it when it differs), else every field."""
    from simulator.spec.model_spec import ModelSpec, load_preset_model, preset_model_names

    try:
        wanted = ModelSpec.model_validate(fields).model_dump(exclude={"preset"})
    except ValueError:
        return fields  # validation of the whole scenario names the bad field
    for name in preset_model_names():
        preset = load_preset_model(name).model_dump(exclude={"preset"})
        if {**preset, "seq_len": wanted["seq_len"]} == wanted:
            out: dict[str, Any] = {"preset": name}
            if preset["seq_len"] != wanted["seq_len"]:
                out["seq_len"] = wanted["seq_len"]
            return out
    return fields


ORDER = ("name", "description", "stack", "model", "cluster", "parallel", "training")


def finish(draft: Draft) -> dict[str, Any]:
    """The draft's sections in the bundled scenarios' order, validated; a problem is one
    line per rule broken (field, value, fix)."""
    from simulator.spec.load import scenario_from_dict

    data = {k: draft.data[k] for k in ORDER if k in draft.data}
    data.update({k: v for k, v in draft.data.items() if k not in data})
    stack = data.get("stack")
    if isinstance(stack, dict) and set(stack) == {"preset"}:
        data["stack"] = stack["preset"]
    try:
        scenario_from_dict(data)
    except ScenarioError as exc:
        raise UserError([Problem(p.field, p.value, f"{p.fix} (in the imported scenario)")
                         if isinstance(p, Problem) else p for p in exc.problems]) from None
    return data


def render(data: dict[str, Any], notes: list[Note], origin: str) -> str:
    """The scenario YAML, headed by where it came from and every note."""
    head = [f"# Imported by `clustersim import` from {origin}."]
    if notes:
        head.append(f"# Not mapped ({len(notes)}): settings the scenario schema has no field "
                    "for, and what is simulated instead.")
        head += [f"#   {n.line()}" for n in notes]
    else:
        head.append("# Every setting that bears on a simulated step was mapped.")
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    return "\n".join(head) + "\n" + body


def emit(text: str, notes: list[Note], out: Path | None) -> None:
    """Write the scenario to ``out`` atomically (stdout without one); list the notes on
    stderr."""
    from simulator.outputs.trace_export import atomic_output

    for n in notes:
        print(f"not mapped: {n.line()}", file=sys.stderr)
    if out is None:
        sys.stdout.write(text)
        return
    try:
        with atomic_output(out) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError([Problem("--out", str(out), f"cannot write it ({exc.strerror or exc})"
                                 )]) from None
    print(f"wrote {out} ({len(notes)} setting(s) not mapped, listed at its top)",
          file=sys.stderr)
