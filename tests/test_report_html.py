"""``report.html``: one self-contained page per run with every section and figure;
rendered in headless Chromium where one is installed."""

from __future__ import annotations

import base64
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from small_scenario import SMALL

from simulator.cli.main import main
from simulator.outputs.report_html import FIGURES, REPORT, SECTIONS

PNG = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """Sections (id -> heading), images (section, src) and links of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, str] = {}
        self.images: list[tuple[str, str]] = []
        self.links: list[str] = []
        self.external: list[str] = []
        self._section = ""
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section":
            self._section = a.get("id") or ""
        elif tag == "h2":
            self._in_h2 = True
        elif tag == "img":
            self.images.append((self._section, a.get("src") or ""))
        elif tag == "a":
            self.links.append(a.get("href") or "")
        if tag in ("script", "link", "iframe"):
            self.external.append(tag)

    def handle_endtag(self, tag: str) -> None:
        self._in_h2 = self._in_h2 and tag != "h2"

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.sections[self._section] = data


def _run(tmp_path: Path, *flags: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), *flags]) == 0
    return out


def _page(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_report_has_every_section_and_inlines_every_figure(tmp_path: Path) -> None:
    out = _run(tmp_path, "--what-if")
    page = _page(out / REPORT)
    assert page.sections == SECTIONS
    assert {s for s, _ in page.images} == set(FIGURES)
    for section, src in page.images:
        head, _, data = src.partition(",")
        assert head == "data:image/png;base64", section
        assert base64.b64decode(data) == (out / FIGURES[section]).read_bytes()
    assert not page.external and "trace.json" in page.links
    text = (out / REPORT).read_text(encoding="utf-8")
    assert "what bounds this step" in text and "step time" in text
    assert REPORT in (out / "manifest.json").read_text()


def test_report_of_an_analytic_run_says_what_is_missing(tmp_path: Path) -> None:
    out = _run(tmp_path, "--method", "analytic", "--no-plots")
    page = _page(out / REPORT)
    assert page.sections == SECTIONS and page.images == []
    text = (out / REPORT).read_text(encoding="utf-8")
    assert "No trace: an analytic run" in text and "--what-if</code>" in text


def test_scenario_text_is_escaped(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("name: small", "name: '<b>x</b>'"))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-plots", "--method",
                 "analytic"]) == 0
    text = (out / REPORT).read_text(encoding="utf-8")
    assert "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text


def test_plot_writes_the_report_again(tmp_path: Path) -> None:
    out = _run(tmp_path, "--no-plots")
    assert _page(out / REPORT).images == []
    assert main(["plot", str(out)]) == 0
    assert {s for s, _ in _page(out / REPORT).images} == set(FIGURES)


def _chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
             "chrome", "headless_shell")
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="no Chromium binary installed (chromium, "
                    "chromium-browser, google-chrome or headless_shell on PATH)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    out = _run(tmp_path)
    shot = tmp_path / "report.png"
    browser = _chromium()
    assert browser is not None
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    "--window-size=1280,6000", f"--screenshot={shot}",
                    (out / REPORT).resolve().as_uri()], check=True, timeout=120,
                   capture_output=True)
    data = shot.read_bytes()
    assert data.startswith(PNG)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 6000)
    assert len(data) > 50_000  # text and three figures, not a blank page
