"""The registry of the two-rank terms: each term's module by name, and what every one of
them offers (:class:`Term`).

The collectives worker reads :data:`TERMS` to add each term's flag and, after the
collective sweep, to measure the terms asked for in this order (the DTensor term last: a
hang there costs the launch no other term); the launcher reads it to ask for the terms
not yet in the results file; the fitter reads it to fit each term's record, and writes
them in :data:`PROFILE_ORDER`, the order of every profile written so far. A new term is a
module with :class:`Term`'s members and one line in each.
"""

from __future__ import annotations

from typing import Any, Protocol

from calibration.microbench.terms import (
    collective_sync,
    funcol_host,
    interference,
    rank_spread,
    send_sync,
)

Record = dict[str, Any]


class Term(Protocol):
    """A two-rank term's module, as the worker, the launcher and the fitter use it."""

    KIND: str  # its records' kind, and its name in the registry and the provenance
    OP: str  # the ``op`` its records name
    FLAG: str  # the collectives worker's flag that asks for it
    HELP: str  # that flag's help line
    FIT_FIELDS: tuple[str, ...]  # what the profile's ``provenance.fit`` keeps of the record

    def key(self, device: str, threads: int) -> str:
        """The results file's key of its record."""

    def rounds(self, device: str, group: Any, dev: str) -> Record:
        """Its measurements, on ranks 0 and 1 of ``group`` (each runs this)."""

    def summary(self, rec: Record) -> str:
        """The line rank 0 prints with the record."""

    def fit(self, records: list[Record]) -> tuple[Any, Record | None]:
        """Its figure from the latest successful record of ``records``, and that record."""

    def uncertainty(self, rec: Record | None) -> float | None:
        """The figure's spread (a relative σ), None where the record cannot say."""

    def provenance(self, rec: Record) -> tuple[int, dict[str, Any]]:
        """Its samples and what ``provenance.terms`` says of the record."""


#: the terms, in the order the worker measures them
TERMS: dict[str, Term] = {
    "interference": interference,
    "collective_sync": collective_sync,
    "send_sync": send_sync,
    "rank_spread": rank_spread,
    "funcol_host": funcol_host,
}
#: the order a profile lists them in (provenance, uncertainty, samples)
PROFILE_ORDER = ("interference", "collective_sync", "send_sync", "funcol_host", "rank_spread")


def in_profile_order() -> dict[str, Term]:
    """:data:`TERMS` in :data:`PROFILE_ORDER`."""
    return {name: TERMS[name] for name in PROFILE_ORDER}
