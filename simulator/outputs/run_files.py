"""Output files read back: ``results.json`` (and its tables), the span table and
``measured.json``.

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
    tables: dict[str, str] | None = None  # results key -> Parquet file beside it


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
    """``results.json`` as a dict the plots can draw, with the tables it names read
    back in place (:func:`simulator.outputs.result_tables.attach_tables`)."""
    from simulator.outputs.result_tables import attach_tables

    fix = "run the scenario again (`clustersim run SCENARIO --out DIR`)"
    results = _validated(Results, read_json(path, "run_dir"), path, "run_dir", fix)
    return attach_tables(results, path.parent)


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


# ------------------------------------------------------------ search and train outputs

TABLE_LIMIT_BYTES = 1 << 30  # a plan of 10^6 candidates writes ~300 MB of CSV
#: The columns each table's figure reads, and which of them must be numbers.
TABLE_COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "plan.csv": (("fits", "pareto", "chosen", "schedule", "zero", "recompute",
                  "sequence_parallel", "micro_batch", "tp", "pp", "dp"),
                 ("peak_memory_GB", "analytic_step_time_s", "engine_step_time_s",
                  "virtual_stages")),
    "sweep.csv": (("error",), ("step_time_s",)),
    "train_timeline.csv": (("event",), ("time_s", "steps", "tokens")),
}


def read_table(path: Path, fix: str) -> pd.DataFrame:
    """A CSV table a command wrote (:data:`TABLE_COLUMNS` by its name), bounded like
    every file (:func:`simulator.loading.read_bytes`), with the columns its figure
    reads and finite numbers in them; else one line naming the file and the column."""
    import io

    import numpy as np
    import pandas as pd

    from simulator.loading import decode_text, read_bytes

    text = decode_text(read_bytes(path, "run_dir", TABLE_LIMIT_BYTES), "run_dir", str(path))
    try:
        table = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""],
                            low_memory=False)  # one type per column, no DtypeWarning
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise UserError([Problem("run_dir", str(path), f"is not a readable CSV table "
                                 f"({str(exc).splitlines()[0][:80]}); {fix}")]) from None
    plain, numeric = TABLE_COLUMNS.get(path.name, ((), ()))
    missing = [c for c in (*plain, *numeric) if c not in table]
    kind = path.name.split(".")[0].split("_")[0]
    if missing:
        raise UserError([Problem("run_dir", str(path), f"is not a clustersim {kind} output: "
                                 f"it has no column {missing[0]!r} ({len(missing)} missing "
                                 f"in all); {fix}")])
    for name in numeric:
        values = pd.to_numeric(table[name], errors="coerce")
        bad = table[name].notna() & ~np.isfinite(values.fillna(np.inf))
        if bad.any():
            raise UserError([Problem(f"{path}: column {name}", table[name][bad].iloc[0],
                                     f"is not a finite number; {fix}")])
        table[name] = values
    return table


class SweepMeta(_Open):
    """What ``plot`` uses of ``sweep.json``."""

    scenario: str | None = None
    method: str = ""
    axes: list[str] = Field(default_factory=list)


class PlanRequestMeta(_Open):
    model: str
    gpus: int
    system: str
    global_batch: int


class PlanMeta(_Open):
    """What ``plot`` uses of ``plan.json``."""

    request: PlanRequestMeta | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    gpu_memory_GB: float | None = Field(default=None, gt=0)


def read_meta(path: Path, model: type[_Open], fix: str) -> dict[str, Any]:
    """A search's JSON summary checked against ``model`` ({} when there is none)."""
    from simulator.loading import read_model

    if not path.exists():
        return {}
    return read_model(path, "run_dir", model, fix).model_dump(exclude_none=True)
