"""The published-runs table: one measured run per row, in the columns of the project's
development set (``docs/validation/published/llm-foundry.csv``):

``name, source, gpu, gpus, framework, model, layers, hidden, heads, kv_heads,
ffn_hidden, vocab, seq_len, experts, topk, tp, pp, vpp, cp, ep, dp, zero_or_fsdp,
sequence_parallel, recompute, micro_batch, global_batch, dtype, other_flags, measured,
unit, notes``.

Read bounded and strictly: the file through the guarded reader (UTF-8, at most
:data:`LIMIT_BYTES`), every column present, each count a whole number (blank where the
run has none: experts, a pipeline's virtual stages), the measurement a positive finite
number. A bad cell is one line naming the file, the row's name and the column.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from simulator.errors import Problem, UserError
from simulator.loading import decode_text, read_bytes

LIMIT_BYTES = 16 << 20  # a table of runs: thousands of rows at most
MAX_ROWS = 100_000
COLUMNS = ("name", "source", "gpu", "gpus", "framework", "model", "layers", "hidden", "heads",
           "kv_heads", "ffn_hidden", "vocab", "seq_len", "experts", "topk", "tp", "pp", "vpp",
           "cp", "ep", "dp", "zero_or_fsdp", "sequence_parallel", "recompute", "micro_batch",
           "global_batch", "dtype", "other_flags", "measured", "unit", "notes")
COUNT = Field(default=None, ge=1, le=10**9)


class Row(BaseModel):
    """One measured run as its table states it (blank counts are None)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=300)
    source: str = ""
    gpu: str = Field(min_length=1)
    gpus: int = Field(ge=1, le=10**7)
    framework: str = ""
    model: str = ""
    layers: int = Field(ge=1, le=10**6)
    hidden: int = Field(ge=1, le=10**7)
    heads: int = Field(ge=1, le=10**6)
    kv_heads: int | None = COUNT
    ffn_hidden: int | None = COUNT
    vocab: int = Field(ge=1, le=10**8)
    seq_len: int = Field(ge=1, le=10**8)
    experts: int | None = COUNT
    topk: int | None = COUNT
    tp: int | None = COUNT
    pp: int | None = COUNT
    vpp: int | None = COUNT
    cp: int | None = COUNT
    ep: int | None = COUNT
    dp: int | None = COUNT
    zero_or_fsdp: str = ""
    sequence_parallel: str = ""
    recompute: str = ""
    micro_batch: int = Field(ge=1, le=10**7)
    global_batch: int = Field(ge=1, le=10**9)
    dtype: str = ""
    other_flags: str = ""
    measured: float = Field(gt=0, le=1e15)
    unit: str = Field(min_length=1)
    notes: str = ""

    @field_validator("measured")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


def _cells(record: dict[str, str]) -> dict[str, str | None]:
    """Blank cells as None (the model's defaults), the rest stripped."""
    return {k: (v.strip() if v.strip() else None) for k, v in record.items()}


def _row(record: dict[str, str], path: Path, line: int) -> Row:
    cells = {k: v for k, v in _cells(record).items() if v is not None}
    try:
        return Row.model_validate(cells)
    except ValidationError as exc:
        err = exc.errors()[0]
        column = ".".join(str(x) for x in err["loc"])
        name = record.get("name") or f"line {line}"
        raise UserError([Problem(f"{path}: row {name!r}, column {column}",
                                 err.get("input"), str(err["msg"]))]) from None


def read_rows(path: Path) -> list[Row]:
    """Every row of the table at ``path``, or a one-line error."""
    text = decode_text(read_bytes(path, "runs table", LIMIT_BYTES), "runs table", str(path))
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError([Problem(str(path), ", ".join(missing), "missing column(s); a runs "
                                 f"table has the columns {', '.join(COLUMNS)}")])
    rows: list[Row] = []
    for line, record in enumerate(reader, start=2):
        if len(rows) >= MAX_ROWS:
            raise UserError([Problem(str(path), f"> {MAX_ROWS:,} rows", "split the table")])
        if None in record:  # more cells than the header has columns
            raise UserError([Problem(f"{path}: line {line}", "extra cells", "a row has one "
                                     "cell per column; quote cells that hold commas")])
        rows.append(_row({k: record[k] or "" for k in COLUMNS}, path, line))
    if not rows:
        raise UserError([Problem(str(path), "no rows", "the table has a header only")])
    return rows
