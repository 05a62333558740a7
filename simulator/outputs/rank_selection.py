"""Which ranks a trace shows: ``--trace-ranks all|stages|R,R,...``.

Kept apart from the trace's tables (pandas) so that ``clustersim run`` checks the
option before it imports anything heavy.
"""

from __future__ import annotations

from collections.abc import Iterable

from simulator.errors import Problem, UserError

RankSelection = str | tuple[int, ...]  # "all", "stages", or explicit ranks


def parse_rank_selection(text: str) -> RankSelection:
    """``all``, ``stages`` or a comma-separated list of ranks (``0,5,17``)."""
    text = text.strip()
    if text in ("all", "stages"):
        return text
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 0:
        raise UserError([Problem("--trace-ranks", text,
                                 "use all, stages, or ranks such as 0,5,17")])
    return tuple(dict.fromkeys(ranks))


def select_ranks(selection: RankSelection, simulated: Iterable[int], tp_dp: int) -> list[int]:
    """The simulated ranks a selection names: ``stages`` is each pipeline stage's lowest
    simulated rank (stage = rank // (tp · dp)). A named rank that was not simulated is
    a user error that lists what was."""
    sim = sorted(simulated)
    if selection == "all":
        return sim
    if isinstance(selection, str):  # "stages"
        firsts: dict[int, int] = {}
        for r in sim:
            firsts.setdefault(r // tp_dp, r)
        return sorted(firsts.values())
    missing = [r for r in selection if r not in set(sim)]
    if missing:
        shown = ", ".join(map(str, sim[:8])) + (", ..." if len(sim) > 8 else "")
        raise UserError([Problem("--trace-ranks", ",".join(map(str, selection)),
                                 f"rank(s) {', '.join(map(str, missing))} not simulated; "
                                 f"simulated ranks: {shown} (--fidelity full simulates all)")])
    return sorted(selection)
