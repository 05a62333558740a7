"""What a wheel ships: every data file the packages read at run time.

``pip install .`` (not editable) ships only the package data pyproject.toml names;
a preset folder left out answers "unknown stack preset" to every user of a wheel
while every test of an editable checkout passes. This test fails first; .ci/run
then installs the real wheel in a fresh venv and runs every bundled scenario from
outside the checkout.
"""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("simulator", "calibration")
#: Files inside the packages that a wheel leaves out on purpose, with why.
NOT_SHIPPED = {
    "calibration/profiles/*.results.jsonl": "the raw measurements behind a profile",
    "calibration/profiles/*-report/*": "the calibration report's figures and tables",
}


def _tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files", *PACKAGES], capture_output=True, text=True,
                            cwd=ROOT, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return listed.stdout.split()


def _shipped(path: str, package_data: dict[str, list[str]]) -> bool:
    package, _, inner = path.partition("/")
    return inner.endswith(".py") or any(
        fnmatch.fnmatch(inner, pattern) for pattern in package_data.get(package, []))


def test_every_data_file_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = config["tool"]["setuptools"]["package-data"]
    files = _tracked()
    assert any(f.startswith("simulator/presets/stacks/") for f in files)
    missing = [f for f in files if not _shipped(f, package_data)
               and not any(fnmatch.fnmatch(f, pattern) for pattern in NOT_SHIPPED)]
    assert missing == []


def test_the_check_sees_a_folder_left_out() -> None:
    data = {"simulator": ["presets/models/*.yaml"]}
    assert _shipped("simulator/presets/models/gpt3-175b.yaml", data)
    assert not _shipped("simulator/presets/stacks/deepspeed.yaml", data)
    assert _shipped("simulator/engine/engine.py", data)
