"""How much work one command may start: each command estimates its size before the
long part and refuses past the limit here, in one line giving the figure and the
option that raises the limit (:func:`check_size`).

The defaults are set so that a command under them finishes in minutes on a laptop
and in memory well below a gigabyte; docs/reliability.md lists them with their
options. A limit is not a property of the model: a larger sweep or plan is fine
on a Dask cluster, and the option says so.
"""

from __future__ import annotations

from simulator.errors import Problem, UserError

#: ``sweep``: grid points (the product of the ``--grid`` value counts), ``--max-points``
MAX_POINTS = 10_000
#: ``plan``: candidate layouts of pass 1, ``--max-candidates``
MAX_CANDIDATES = 200_000
#: ``run`` (and every point of a sweep, a plan or a train): simulated GPUs, folded or
#: not; the estimate walks each rank's groups once, about 3.5 s a million, ``--max-ranks``
MAX_RANKS = 1 << 22
#: ``train``: estimated events of all Monte Carlo runs together (checkpoints; failures
#: and restarts weigh 100 each; the interval scan included), about 2 µs each (40 s),
#: ``--max-events``
MAX_JOB_EVENTS = 20_000_000


def check_size(field: str, value: object, what: str, figure: float, limit: int, option: str,
               fix: str) -> None:
    """Refuse ``figure`` (the ``what`` that ``field = value`` asks for) over ``limit``, in
    one line with the figure, the limit, ``fix`` and the ``option`` that raises it."""
    if figure > limit:
        shown = f"{figure:,.0f}" if figure < 1e15 else f"{figure:.3g}"
        raise UserError([Problem(field, value, f"makes {shown} {what}, over the limit of "
                                 f"{limit:,}; {fix}, or raise the limit with {option} N")])


def check_ranks(world: int, limit: int | None = None, field: str = "parallel",
                option: str = "--max-ranks") -> None:
    """Refuse a simulation of more GPUs than ``limit`` (:data:`MAX_RANKS`): the estimate
    and the engine's groups walk every rank once, folded or not."""
    limit = MAX_RANKS if limit is None else limit
    fix = "simulate a smaller cluster" if option == "--max-ranks" else \
        "simulate a smaller cluster, or simulate it alone with `clustersim run --max-ranks N`"
    if world > limit:
        raise UserError([Problem(field, f"{world:,} GPUs", f"makes {world:,} ranks to "
                                 f"simulate, over the limit of {limit:,}; {fix}"
                                 + (f", or raise the limit with {option} N"
                                    if option == "--max-ranks" else ""))])
