"""Output files read back: ``results.json``, the span table and ``measured.json``.

``clustersim plot`` and ``clustersim compare`` read files that a run wrote, a
user copied, or an interrupted process cut short. Each reader here validates
what its consumer relies on — the JSON decodes (:func:`simulator.loading.read_json`:
UTF-8, no NaN/Infinity, bounded), the fields have the right types, times are
finite and positive where a division follows — and answers anything else with a
one-line :class:`~simulator.errors.UserError` naming the file, the field, the
value and the fix. Fields a consumer does not use pass through unchecked.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simulator.errors import Problem, UserError
from simulator.loading import read_json

if TYPE_CHECKING:
    import pandas as pd

NonNegative = Field(default=None, ge=0)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class MeasuredRank(_Open):
    compute_s: float = Field(ge=0)
    optimizer_s: float | None = NonNegative
    profiled_step_s: float | None = Field(default=None, gt=0)


class Measured(_Open):
    """What ``compare`` uses of ``measured.json`` (written by ``clustersim measure``)."""

    step_time_s: float = Field(gt=0)
    compute_s: float | None = NonNegative
    optimizer_s: float | None = NonNegative
    profiled_step_s: float | None = Field(default=None, gt=0)
    per_rank: list[MeasuredRank] | None = Field(default=None, min_length=1)
    state_bytes: list[float] | None = None

    @model_validator(mode="after")
    def _has_compute(self) -> Measured:
        if self.per_rank is None and self.compute_s is None:
            raise ValueError("needs per_rank or compute_s")
        return self


class MemoryRow(_Open):
    weights: float | None = NonNegative
    gradients: float | None = NonNegative
    optimizer: float | None = NonNegative
    total: float | None = NonNegative
    capacity: float | None = NonNegative


class Results(_Open):
    """What ``plot`` uses of ``results.json`` (written by ``clustersim run``)."""

    step_time_s: float = Field(ge=0)
    bubble_fraction: float | None = None
    memory: list[MemoryRow] = Field(default_factory=list)
    memory_peak_bytes: float | None = NonNegative
    scenario: dict[str, Any] | None = None


def _validated(model: type[_Open], data: Any, path: Path, what: str, fix: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise UserError([Problem(what, str(path), f"holds a JSON {type(data).__name__}, not an "
                                 f"object; {fix}")])
    try:
        model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        value = repr(err.get("input"))[:40]
        raise UserError([Problem(f"{path.name}: {loc}", value,
                                 f"{err['msg']}; {fix}")]) from None
    return data


def read_measured(path: Path) -> dict[str, Any]:
    """``measured.json`` as a dict whose figures ``compare`` can divide by."""
    if not path.exists():
        raise UserError([Problem("run_dir", str(path.parent), f"has no {path.name}; is this a "
                                 "`clustersim measure` output directory?")])
    fix = "measure again (`clustersim measure ... --out DIR`)"
    return _validated(Measured, read_json(path, "run_dir"), path, "run_dir", fix)


def read_results(path: Path) -> dict[str, Any]:
    """``results.json`` as a dict the plots can draw."""
    fix = "run the scenario again (`clustersim run SCENARIO --out DIR`)"
    return _validated(Results, read_json(path, "run_dir"), path, "run_dir", fix)


def read_spans(path: Path, ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """The span table of a run (``timeline.parquet`` or ``timeline.csv``; only ``ranks``
    when given), with finite times; a cut or edited file is a UserError."""
    import pandas as pd
    import pyarrow as pa

    from simulator.outputs.timeline_files import read_timeline

    fix = "run the scenario again (`clustersim run SCENARIO --out DIR`)"
    try:
        spans = read_timeline(path, ranks)
    except (ValueError, TypeError, KeyError, pd.errors.ParserError,
            pd.errors.EmptyDataError, pa.ArrowException) as exc:
        raise UserError([Problem("run_dir", str(path), f"is not a readable span table "
                                 f"({str(exc).splitlines()[0][:80]}); {fix}")]) from None
    times = spans[["start", "end"]].to_numpy()
    if len(spans) and not (pd.notna(times).all() and (abs(times) < 1e30).all()
                           and (times[:, 1] >= times[:, 0]).all()):
        raise UserError([Problem("run_dir", str(path), f"has spans with missing, non-finite or "
                                 f"reversed times; {fix}")])
    return spans
