"""The decision site laid out by a real browser: nothing wider than the page at 1,280 px, no plot
label outside its plot, the answer matching the manifests' own figures, and the README's picture.

Debian's chromium (``.ci/run`` installs it) loads each page with a probe script appended to a copy
whose Content-Security-Policy is removed (the site's own pages run no script). The probe measures
every element's box after layout and writes what it found into the DOM, which ``--dump-dom`` prints.
The site is made from this repository's ``manifests/`` (real H200 runs) plus one run on a card with a
long name, so a long label is exercised.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from capture import costs
from capture import manifest as mf
from capture._cli import main
from capture.decide.runs import run_definition
from capture.fmt import percent_str, seconds_str
from test_results_helpers import Signer

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
H200_RUN = MANIFESTS / "nvidia-h200-x1" / "2026-12-02" / "ff69c22bd470.toml"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGE_WIDTH = 1280
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROBE = """<script>
(function () {
  var W = window.innerWidth, wide = [], clipped = [];
  var all = document.body.getElementsByTagName('*');
  for (var i = 0; i < all.length; i++) {
    var r = all[i].getBoundingClientRect();
    if (r.width > 0 && (r.right > W + 0.5 || r.left < -0.5))
      wide.push(all[i].tagName + ' ' + Math.round(r.left) + '..' + Math.round(r.right) + ': ' + (all[i].textContent || '').slice(0, 80));
  }
  var texts = document.querySelectorAll('svg text');
  for (var j = 0; j < texts.length; j++) {
    var t = texts[j].getBoundingClientRect(), s = texts[j].ownerSVGElement.getBoundingClientRect();
    if (t.left < s.left - 0.5 || t.right > s.right + 0.5) clipped.push(texts[j].textContent);
  }
  var out = document.createElement('pre');
  out.id = 'layout-probe';
  out.textContent = JSON.stringify({width: W, scrollWidth: document.documentElement.scrollWidth, wide: wide, clipped: clipped});
  document.body.appendChild(out);
})();
</script>"""

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (.ci/run installs Debian's chromium)")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


def layout(page: Path, tmp_path: Path, extra: str = "") -> dict:
    """The probe's findings for ``page`` at the page width (a copy without the CSP, probe appended)."""
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text())
    probed = page.with_name(f".probe-{page.name}")
    probed.write_text(text.replace("</body>", extra + PROBE + "</body>"))
    try:
        dom = _chromium(tmp_path, f"--window-size={PAGE_WIDTH},900", "--dump-dom", probed.as_uri())
    finally:
        probed.unlink()
    found = re.search(r'<pre id="layout-probe">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stderr[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    extra = tmp_path_factory.mktemp("long-name")
    signer = Signer(extra, "alice@lab")
    (extra / "allowed_signers").write_text(signer.allowed_line)
    body = mf.parse_body(mf.split_signed(H200_RUN.read_bytes())[0])
    long = copy.deepcopy(body)  # a card the catalog does not know, so its label is the device's long name
    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition (a board with a long marketing name, partitioned)"
    long["accelerator"]["model"] = long["trial"]["run"]["device_name"] = name
    stats = long["trial"]["stats"]
    stats["tokens_per_s"] /= 2  # slower, so the H200 runs keep the answer
    stats["step_time_mean_s"] *= 2
    signer.write(extra / "long.toml", long)
    out = tmp_path_factory.mktemp("site") / "site"
    assert main(["decide", str(MANIFESTS), str(extra), "-o", str(out)]) == 0
    return out


def test_no_element_is_wider_than_the_page(site, tmp_path, capsys):
    capsys.readouterr()
    pages = [site / "index.html", *sorted((site / "runs").iterdir())]
    assert len(pages) > 5
    for page in pages:
        found = layout(page, tmp_path)
        assert found["width"] == PAGE_WIDTH
        assert found["wide"] == [] and found["scrollWidth"] <= PAGE_WIDTH, (page.name, found["wide"][:5])
        assert found["clipped"] == [], (page.name, found["clipped"][:5])
    # the probe is not vacuous: an element wider than the page, and a label cut by its plot, are found
    found = layout(site / "index.html", tmp_path, '<div style="width:1500px">wide</div>'
                   '<svg width="100" height="20"><text x="-40" y="12">cut off</text></svg>')
    assert any("wide" in w for w in found["wide"]) and found["clipped"] == ["cut off"]
    index = (site / "index.html").read_text()
    assert "NVIDIA RTX PRO 6000 Blackwell Server Edition (a board with a long marketing name, partitioned) x1" in index


def test_the_answer_matches_the_manifests(site, tmp_path):
    dom = _chromium(tmp_path, f"--window-size={PAGE_WIDTH},900", "--dump-dom", (site / "index.html").as_uri()).stdout
    answers = [re.sub(r"<[^>]+>", "", li) for li in
               re.findall(r"<li>(.*?)</li>", dom.split('<ul class="answer">', 1)[1].split("</ul>", 1)[0], re.S)]
    assert answers and all(a.startswith(f"Group {i}: ") for i, a in enumerate(answers, 1))
    # group 1: the H200 llama-1b full fine-tunes; its cheapest run, from the manifests themselves
    trials = {}
    for p in MANIFESTS.rglob("*.toml"):
        if ".capture" in p.parts:
            continue
        data = mf.parse_body(mf.split_signed(p.read_bytes())[0])
        if data.get("kind") == "trial":
            trials[p.stem] = data
    group1 = run_definition(trials["ff69c22bd470"])
    mine = {cid: costs.figures(d) for cid, d in trials.items() if run_definition(d) == group1}
    cheapest = min((cid for cid in mine if mine[cid].projected_cost is not None), key=lambda c: mine[c].projected_cost)
    fig = mine[cheapest]
    used = trials[cheapest]["trial"]["fit"]["measured_bytes"]
    headroom = 1 - used / trials[cheapest]["accelerator"]["memory_per_device_bytes"]
    answer = answers[0]
    assert f"cheapest H200 141GB x1 single (run {cheapest}): " in answer
    assert (f"{costs.money_str(fig.projected_cost, fig.currency)} and {seconds_str(fig.projected_time_s)} to the target"
            f", memory headroom {percent_str(headroom)}") in answer
    assert "not tested: A100 80GB SXM, H100 80GB SXM, MI300X 192GB (would fit in memory, estimate)" in answer


def test_readme_picture_is_this_repositorys_manifests(tmp_path, capsys):
    """The screenshot of the site of manifests/ alone (real H200 runs), as the README shows it."""
    out = tmp_path / "site"
    assert main(["decide", str(MANIFESTS), "-o", str(out)]) == 0
    capsys.readouterr()
    artifacts = ROOT / "out" / "ci-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "decide-site.png"
    done = _chromium(tmp_path, f"--window-size={PAGE_WIDTH},1500", f"--screenshot={shot}", (out / "index.html").as_uri())
    assert done.returncode == 0 and shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("CAPTURE_UPDATE_SCREENSHOT"):  # how docs/img/decide-site.png was made
        shutil.copyfile(shot, ROOT / "docs" / "img" / "decide-site.png")
