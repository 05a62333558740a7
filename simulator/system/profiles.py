"""Reading a hardware profile: a bundled system preset by name or a profile file,
strictly (every field stated, every number finite and in range, a calibrated profile
with its provenance), cached by path and modification time.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from simulator.errors import Problem, UserError
from simulator.loading import PRESETS_DIR, read_yaml
from simulator.system.curves import EfficiencyCurve
from simulator.system.hardware import HardwareProfile
from simulator.system.link_specs import AlphaBeta

SYSTEMS_DIR = PRESETS_DIR / "systems"


def preset_system_names() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.yaml"))


#: Fields a profile file may leave out (older profiles predate them).
OPTIONAL_FIELDS = ("description", "provenance", "power", "class_efficiency", "interference",
                   "collective_sync_us", "collective_sync_curve", "collective_sync_burst",
                   "send_sync_us",
                   "uncertainty", "nvls", "host_serial",
                   "host_overhead_us", "dtensor_overhead_us", "host_optimizer_us",
                   "dtensor_gemm_us", "pipeline_action_us",
                   "funcol_overhead_us", "funcol_sync_us", "funcol_host", "rank_spread",
                   "rank_excess",
                   "attention_kernels", "compute_capability", "nvlink_domain_gpus",
                   "runtime", "fp8_recipes", "fp8_gemm_efficiency", "sms", "gemm_tiles",
                   "gemm_depth")


def _unstated(model: type[BaseModel], data: Any, loc: str = "") -> list[str]:
    """Fields of ``model`` (and its sections) that ``data`` does not state."""
    if not isinstance(data, dict):
        return []
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if name not in data and name not in OPTIONAL_FIELDS:
            out.append(loc + name)
        elif name in data and isinstance(ann, type) and issubclass(ann, BaseModel) \
                and ann is not EfficiencyCurve:
            out.extend(_unstated(ann, data[name], f"{loc}{name}."))
    tables = data.get("collectives") if model is HardwareProfile else None
    for op, links in (tables or {}).items() if isinstance(tables, dict) else ():
        for link, entry in (links or {}).items() if isinstance(links, dict) else ():
            out.extend(_unstated(AlphaBeta, entry, f"collectives.{op}.{link}."))
    return out


def _unprovenanced(data: Any) -> str | None:
    """Calibrated collectives come with the provenance ``calibrate`` writes after them."""
    if isinstance(data, dict) and data.get("collectives") and not data.get("provenance"):
        return ("has calibrated collectives but no provenance (cut short?); calibrate "
                "writes provenance after the collectives")
    return None


def validate_profile(data: Any, path: str) -> HardwareProfile:
    """A profile file's data, strictly validated; UserError naming field, value and fix."""
    from pydantic import ValidationError

    missing = _unstated(HardwareProfile, data)
    if missing:
        raise UserError([Problem("cluster.system", path, f"profile does not state "
                                 f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                                 " (cut short?); every field must be given")])
    try:
        profile = HardwareProfile.model_validate(data, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        value = repr(first.get("input"))[:40]
        raise UserError([Problem("cluster.system", path, f"not a valid hardware profile: "
                                 f"{loc} = {value}: {first['msg']}")]) from None
    bad = _unprovenanced(data)
    if bad:
        raise UserError([Problem("cluster.system", path, bad)])
    return profile


@lru_cache(maxsize=64)
def _load_profile_file(path: str, mtime: float) -> HardwareProfile:
    return validate_profile(read_yaml(Path(path), "cluster.system"), path)


def load_system(name_or_path: str, base_dir: Path | None = None) -> HardwareProfile:
    """A bundled preset by name, or a profile YAML by path (relative to ``base_dir``)."""
    if name_or_path in preset_system_names():
        path = SYSTEMS_DIR / f"{name_or_path}.yaml"
    else:
        try:  # ~nosuchuser/... and names longer than the file system allows
            path = Path(name_or_path).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            found = path.suffix.lower() in (".yaml", ".yml") and path.exists()
        except (RuntimeError, OSError) as exc:
            raise UserError([Problem("cluster.system", name_or_path,
                                     f"cannot look it up ({exc}); give a preset name or "
                                     "the path of a profile .yaml file")]) from None
        if not found:
            import difflib

            near = difflib.get_close_matches(name_or_path, preset_system_names(), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise UserError([Problem("cluster.system", name_or_path,
                                     f"{hint}not a preset ({', '.join(preset_system_names())}) "
                                     "nor an existing profile .yaml file")])
    return _load_profile_file(str(path.resolve()), path.stat().st_mtime)
