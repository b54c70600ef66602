"""`obs dump diff --html` and `--json`: the page is self-contained and shows the producer's row in a real headless
browser (Chromium, where one is installed: `.ci/run` installs Debian's); the JSON document is strict JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zlib

import pytest

from obs.features.dump import DumpReader
from obs.features.dump.diff import compare_dumps
from obs.features.dump.diff.render import render_html, report_dict
from tests.obs.cli.test_cli import obs_cli
from tests.obs.features.dump.diff.test_producer import dump

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def headless(binary: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Chromium headless with its profile and caches under ``tmp_path`` (its singleton socket stays in the system's
    temporary folder: a path under pytest's is too long for a socket); as root it runs only without its sandbox."""
    home = tmp_path / "browser-home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache")}
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--hide-scrollbars", f"--user-data-dir={home / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)


def png_pixels_vary(path) -> bool:
    """Whether a PNG's image data holds more than one colour's worth of bytes (a blank page compresses to
    almost nothing and filters to zeros)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        if data[at + 4:at + 8] == b"IDAT":
            chunks.append(data[at + 8:at + 8 + length])
        at += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    return len(set(raw[:1_000_000])) > 64


@pytest.fixture(name="gelu_dumps")
def _gelu_dumps(tmp_path):
    return dump(tmp_path / "tanh", saved="statistic", tanh_at=2), dump(tmp_path / "exact", saved="statistic")


def test_the_html_page_is_self_contained_and_names_the_producer(tmp_path, gelu_dumps):
    a, b = gelu_dumps
    page = tmp_path / "report.html"
    result = obs_cli("dump", "diff", str(a), str(b), "--html", str(page))
    assert result.returncode == 1 and "wrote HTML report" in result.stderr and str(page) in result.stderr
    text = page.read_text()
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    assert text == render_html(report, a=os.path.abspath(a), b=os.path.abspath(b))
    # nothing fetched: no stylesheet, script or image from elsewhere (the one URL is the SVG namespace)
    assert not re.search(r"<link|<img|src=|@import|url\(", text)
    assert re.findall(r"https?://[^\s\"'<>]+", text) == ["http://www.w3.org/2000/svg"]
    assert "<svg" in text and "<polyline" in text and text.count("<tr class=") >= len(report.ops)
    row = re.search(r'<tr class="producer" id="producer">(.*?)</tr>', text)
    assert row and report.producer.name_a in row.group(1)


def test_the_page_opens_in_a_headless_browser_with_the_producers_row(tmp_path, gelu_dumps):
    binary = browser()
    if binary is None:
        pytest.skip(f"no headless browser here (none of {', '.join(BROWSERS)} on PATH; .ci/run installs chromium)")
    a, b = gelu_dumps
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    page = tmp_path / "report.html"
    page.write_text(render_html(report, a=str(a), b=str(b)))
    done = headless(binary, tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    row = re.search(r'<tr class="producer" id="producer">(.*?)</tr>', dom, re.S)
    assert row, dom[:2000]
    assert report.producer.name_a in row.group(1) and "<td>producer</td>" in row.group(1)
    assert "producer (the first op whose inputs agree" in dom and "<svg" in dom
    shot = tmp_path / "report.png"
    done = headless(binary, tmp_path, f"--screenshot={shot}", "--window-size=1400,1300", page.as_uri())
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    assert shot.stat().st_size > 20_000 and png_pixels_vary(shot)


def test_the_json_document_is_strict_json_with_the_producer_first(gelu_dumps):
    a, b = gelu_dumps
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    doc = report_dict(report, a=str(a), b=str(b), top=3)
    text = json.dumps(doc, allow_nan=False)  # infinities and NaN are strings
    assert json.loads(text)["producer"]["name_a"] == report.producer.name_a
    assert len(doc["divergent"]) == 3 and doc["divergent_count"] == len(report.divergent) > 3
    assert doc["divergent"][0]["index"] == report.producer.index and doc["first"]["io"] == "output"
    assert doc["tolerance"] == {"preset": None, "rtol": None, "atol": None, "described": "rtol=1e-05, atol=1e-08"}
    assert {t["io"] for t in doc["producer"]["tensors"]} == {"input", "output"}
