"""notebooks/calibrate.ipynb runs top to bottom: a tiny CPU calibration and its report."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "calibrate.ipynb"


def test_calibrate_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel starts in tmp_path (its outputs land there) and finds the package on PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert (tmp_path / "cpu-tiny.yaml").exists()
    for name in ("gemm.png", "collectives.png", "fit_errors.md"):
        assert (tmp_path / "report" / name).exists(), name
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum(1 for o in outputs if "image/png" in o.get("data", {})) == 4
