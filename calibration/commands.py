"""The ``clustersim`` commands this package adds, as the simulator's CLI discovers them.

pyproject.toml registers :data:`COMMANDS` under the ``clustersim.commands`` entry-point
group; the simulator never names this package. Each entry is one help line until the
command is run (or its ``--help`` asked for): only then is its module imported and its
``add_parser(sub)`` called, so ``clustersim --help`` imports nothing of calibration
beyond this table (no torch). A test checks each help line against the one its module
registers.
"""

from __future__ import annotations

#: command -> (module with ``add_parser(sub)``, the help line ``clustersim --help`` lists)
COMMANDS: dict[str, tuple[str, str]] = {
    "calibrate": ("calibration.microbench.calibrate", "measure this machine (GEMM, "
                  "attention, memory, collectives) and write a hardware profile"),
    "measure": ("calibration.measured.measure", "train a small GPT with real TP/PP/DP "
                "under torchrun and record step times"),
    "compare": ("calibration.measured.compare", "simulate a measured run's scenario and "
                "compare with the measurement"),
    "host-cost": ("calibration.measured.host_cost", "time eager PyTorch's host cost per "
                  "kernel (the measured GPT at a degenerate size) and write it into a profile"),
    "validation": ("calibration.measured.validation", "measure fixed small configurations "
                   "and compare each with its simulation (docs/validation.md's table)"),
    "fake-memory": ("calibration.measured.fake_memory_cli", "PyTorch's own memory accounting "
                    "(FakeTensorMode, FSDPMemTracker) of one FSDP2 step of the scenario, "
                    "beside the simulator's memory table"),
}
