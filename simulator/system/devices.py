"""Which bundled system preset a GPU is: one table, read by the measured runs' scenario
(``cluster.system``), by the calibration's datasheet peaks and by the published runs'
scenarios (their ``gpu`` column, :mod:`simulator.published.mapping`), so that all name
the same preset for the same device.

The table is read most specific first: a name matches an entry when it holds every one of
the entry's words (case ignored). ``torch.cuda.get_device_name()`` carries an A100's
memory in every spelling ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA
A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"), which picks its preset; a device that is
none of these has no preset (the scenario names a slug of it, the calibration uses the
best rates measured).
"""

from __future__ import annotations

#: (words the device name holds, bundled system preset), most specific first
DEVICE_PRESETS: tuple[tuple[tuple[str, ...], str], ...] = (
    # "NVIDIA GB200" holds "b200": the Grace-Blackwell part (its NVL72 rack) first
    (("gb200",), "gb200-nvl72"),
    (("b200",), "dgx-b200"),
    (("h200",), "dgx-h200"),
    (("h800",), "hgx-h800"),
    (("h100",), "dgx-h100"),
    (("a100", "80gb"), "dgx-a100-80gb"),
    (("a100", "40gb"), "dgx-a100-40gb"),
    # An A100 whose name does not say its memory (no driver reports one so; a name typed
    # by hand): the 40 GB part, the smaller and slower of the two. A scenario then never
    # fits a run into memory the device may not have, and the calibration reads the
    # datasheet peak only where the measured rate does not beat it, so a faster 80 GB part
    # keeps its measured bandwidth.
    (("a100",), "dgx-a100-40gb"),
)


def preset_for(device_name: str) -> str | None:
    """The bundled system preset of a CUDA device, by its name; None for one without."""
    name = device_name.lower()
    return next((preset for words, preset in DEVICE_PRESETS
                 if all(word in name for word in words)), None)
