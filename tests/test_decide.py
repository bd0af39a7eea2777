"""`capture decide`: grouping, ranking, cost arithmetic, trust, and the static site in a real browser.

The trials are real: one `capture trial --example tiny` on the CPU (once per module), then varied
by editing its body and re-signing with a test key (another card, a scaling table, LoRA, an
unsigned copy, a tampered copy), plus the H200 manifests committed in ../manifests.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capture import manifest as mf
from capture._cli import main
from capture.decide.rank import decide, significant
from capture.decide.runs import expand, open_all
from capture.decide.text import COLUMNS
from capture.fmt import number_str
from capture.trial.fit import load_catalog
from test_results_helpers import Signer

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
H200_RUN = MANIFESTS / "nvidia-h200-x1" / "2026-12-02" / "ff69c22bd470.toml"
H200_BYTES = 150754820096


@pytest.fixture(scope="module")
def tiny_body(tiny_cpu_trial) -> dict:
    """One real tiny trial on the CPU (tests/conftest.py), its body parsed back."""
    return mf.parse_body(mf.split_signed(tiny_cpu_trial.path.read_bytes())[0])


def _reprice(m: dict, price: float) -> None:
    """Keep [trial.cost] consistent, as the runner writes it, for another price."""
    c = m["trial"]["cost"]
    c.update(price_per_hour=price, price_source="--price-per-hour", trial_cost=c["wall_total_s"] / 3600 * price)
    c["cost_per_million_trained_tokens"] = c["trial_cost"] / (c["trained_tokens"] / 1e6)


def _as_h200(m: dict, speedup: float) -> None:
    m["accelerator"] = {"vendor": "nvidia", "model": "NVIDIA H200", "count": 2, "runtime": "cuda",
                        "runtime_version": "13.0", "memory_per_device_bytes": H200_BYTES, "driver_version": "580.159.04"}
    m["trial"]["run"]["device_name"] = "NVIDIA H200"
    s = m["trial"]["stats"]
    s["tokens_per_s"] *= speedup
    s["step_time_mean_s"] /= speedup
    s["step_time_median_s"] /= speedup
    s["step_time_cv"] = 0.01
    per_step = s["tokens_per_step"]
    m["scaling"] = {
        "world_size": 2, "nproc_per_node": 2, "nnodes": 1, "strategies": ["ddp", "fsdp"], "device_type": "cuda",
        "batch": {"tokens_per_optimizer_step": per_step, "per_rank_micro_batch": 1, "per_rank_grad_accum": 1,
                  "method": "micro_batch divided by world_size"},
        "baseline": {"throughput_tokens_per_s": s["tokens_per_s"], "step_time_median_s": s["step_time_median_s"]},
        "ddp": {"throughput_tokens_per_s": s["tokens_per_s"] * 1.8, "efficiency": 0.9, "step_time_median_s": 0.01,
                "step_time_cv": 0.02, "tokens_per_optimizer_step": per_step, "peak_memory_per_rank_bytes": 2 * 2**30,
                "recovery": {"verdict": "bit-exact"}},
        "fsdp": {"throughput_tokens_per_s": s["tokens_per_s"] * 1.2, "efficiency": 0.6, "step_time_median_s": 0.02,
                 "step_time_cv": 0.02, "tokens_per_optimizer_step": per_step, "peak_memory_per_rank_bytes": 2**30,
                 "recovery": {"verdict": "diverged at step 3"}},
        "reading": "choose DDP for throughput",
    }


@pytest.fixture(scope="module")
def corpus(tiny_body, tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    alice = Signer(tmp_path_factory.mktemp("keys"), "alice@lab")
    (folder / "allowed_signers").write_text(alice.allowed_line)
    cpu = copy.deepcopy(tiny_body)
    _reprice(cpu, 2.0)
    h200 = copy.deepcopy(tiny_body)
    _as_h200(h200, 40.0)
    _reprice(h200, 3.0)
    lora = copy.deepcopy(tiny_body)
    run = lora["trial"]["run"]
    run.update(method="lora", params_trainable=4096, params_total=run["params_total"] + 4096)  # base + adapter
    fast = copy.deepcopy(h200)
    fast["trial"]["stats"]["tokens_per_s"] *= 10
    fast["trial"]["stats"]["step_time_mean_s"] /= 10
    paths = {"cpu": folder / "cpu.toml", "h200": folder / "h200.toml", "lora": folder / "lora.toml",
             "unsigned": folder / "unsigned.toml", "tampered": folder / "tampered.toml"}
    alice.write(paths["cpu"], cpu)
    alice.write(paths["h200"], h200)
    alice.write(paths["lora"], lora)
    paths["unsigned"].write_bytes(mf.dumps(fast))  # would be the fastest and cheapest if it were believed
    raw = alice.write(paths["tampered"], fast)
    assert raw.count(b'name = "tiny"') == 1
    paths["tampered"].write_bytes(raw.replace(b'name = "tiny"', b'name = "tinx"'))  # one byte of the body
    (folder / "broken.toml").write_bytes(b"schema_version = [\n")
    return folder, paths, {"cpu": cpu, "h200": h200, "lora": lora}


def _decide(folder, prices=None, target=None):
    runs, files = open_all(expand([str(folder)]), trust=str(folder / "allowed_signers"))
    return decide(runs, load_catalog(), prices or {}, target), files


def test_groups_rank_and_leave_out_with_reasons(corpus):
    folder, paths, bodies = corpus
    groups, files = _decide(folder)
    state = {Path(f.path).name: f.state for f in files}
    assert "allowed_signers" not in state  # only *.toml files are opened
    assert state["cpu.toml"] == state["h200.toml"] == state["lora.toml"] == "ok"
    assert state["unsigned.toml"] == "unsigned" and state["tampered.toml"] == "invalid"
    assert state["broken.toml"] == "malformed"
    full, lora = groups
    assert {Path(r.path).name for r in full.runs} == {"cpu.toml", "h200.toml", "unsigned.toml", "tampered.toml"}
    assert [Path(r.path).name for r in lora.runs] == ["lora.toml"]
    assert lora.left_out_reason == "not ranked against group 1 (a different run definition): method: lora vs full"
    ranked = full.ranked
    # The CPU run is named after this machine's CPU, as the trial recorded it (catalogued or not).
    device = bodies["cpu"]["trial"]["run"]["device_name"]
    model = bodies["cpu"]["host"].get("cpu_model")
    assert device == (f"CPU: {model}" if model else "CPU")
    card = load_catalog().match(device)
    cpu_label = f"{card.name if card else device} x1 single"
    # cheapest per million tokens first: two devices at efficiency 0.9 cost more per token than one
    assert [c.label for c in ranked] == ["H200 141GB x1 single", "H200 141GB x2 ddp", "H200 141GB x2 fsdp", cpu_label]
    for c in full.configs:  # the unsigned and tampered copies are shown, never ranked
        if Path(c.run.path).name in ("unsigned.toml", "tampered.toml"):
            assert c.rank_cost is None and c.rank_time is None
            assert any(n.startswith("not ranked: signature ") for n in c.notes)
    by_time = sorted(ranked, key=lambda c: c.rank_time)  # ... but reach the target sooner
    assert [c.label for c in by_time] == ["H200 141GB x2 ddp", "H200 141GB x2 fsdp", "H200 141GB x1 single", cpu_label]


def test_a_run_whose_loss_went_nan_is_listed_never_ranked(tiny_body, tmp_path):
    """A NaN loss (lr too high, fp16 overflow) still gives tokens/s, the fastest of all here: it
    is shown with the step it went wrong, and ranked nowhere. Older manifests have only the
    losses (NaN written as the string "nan"): the same."""
    (tmp_path / "keys").mkdir()
    alice = Signer(tmp_path / "keys", "alice@lab")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "allowed_signers").write_text(alice.allowed_line)
    good = copy.deepcopy(tiny_body)
    _reprice(good, 2.0)
    nan_new, nan_old = copy.deepcopy(good), copy.deepcopy(good)
    for m in (nan_new, nan_old):
        m["trial"]["steps"]["loss"] = [3.1] + ["nan"] * (len(m["trial"]["steps"]["loss"]) - 1)
        m["trial"]["stats"]["tokens_per_s"] *= 100
    nan_new["trial"]["stats"].update(loss_finite=False, loss_first_nonfinite_step=2)
    for name, body in (("good", good), ("nan-new", nan_new), ("nan-old", nan_old)):
        alice.write(tmp_path / "runs" / f"{name}.toml", body)
    (group,) = _decide(tmp_path / "runs")[0]
    by = {Path(c.run.path).stem: c for c in group.configs}
    assert [Path(c.run.path).stem for c in group.ranked] == ["good"] and by["good"].rank_cost == 1
    for name in ("nan-new", "nan-old"):
        c = by[name]
        assert c.rank_cost is None and c.rank_time is None and c.loss_nonfinite_step == 2
        assert "not ranked: the loss is not finite from measured step 2" in c.notes
        assert c.to_json()["loss_nonfinite_step"] == 2


def test_a_run_that_did_not_fit_shows_its_verdict_once_and_no_headroom(tiny_body, tmp_path):
    """What it held when it stopped is not a step's peak: no free-memory figure, and the verdict,
    which already says "does not fit", is not said twice."""
    (tmp_path / "keys").mkdir()
    alice = Signer(tmp_path / "keys", "alice@lab")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "allowed_signers").write_text(alice.allowed_line)
    oom = copy.deepcopy(tiny_body)
    oom["trial"]["fit"].update(fits=False, failed_at="training step 1 of 4",
                               verdict="does not fit: out of memory at training step 1 of 4")
    old = copy.deepcopy(oom)
    old["trial"]["fit"]["verdict"] = "out of memory"  # a verdict without the words: they are added
    for name, body in (("oom", oom), ("old", old)):
        alice.write(tmp_path / "runs" / f"{name}.toml", body)
    (group,) = _decide(tmp_path / "runs")[0]
    by = {Path(c.run.path).stem: c for c in group.configs}
    assert "does not fit: out of memory at training step 1 of 4" in by["oom"].notes
    assert "does not fit: out of memory" in by["old"].notes
    for c in by.values():
        assert c.headroom_fraction is None and c.peak_memory_bytes is None
        assert not any(n.startswith("does not fit: does not fit") for n in c.notes)


def test_a_run_that_could_not_be_resumed_is_ranked_with_the_reason_beside_it(tiny_body, tmp_path):
    """Its speed and cost stand, so it is ranked; but a failed or diverged recovery is said under
    the table, where a 100-column terminal still shows it (the recovery column is left out there)."""
    (tmp_path / "keys").mkdir()
    alice = Signer(tmp_path / "keys", "alice@lab")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "allowed_signers").write_text(alice.allowed_line)
    good = copy.deepcopy(tiny_body)
    _reprice(good, 2.0)
    failed, diverged = copy.deepcopy(good), copy.deepcopy(good)
    failed["trial"]["recovery"] = {"verdict": "failed: RuntimeError: unexpected pos 20192109440 vs 20192109336"}
    diverged["trial"]["recovery"] = {"verdict": "diverged at step 3 (loss differs by 0.01)",
                                     "verdict_kind": "beyond_band"}
    for name, body in (("good", good), ("failed", failed), ("diverged", diverged)):
        alice.write(tmp_path / "runs" / f"{name}.toml", body)
    (group,) = _decide(tmp_path / "runs")[0]
    by = {Path(c.run.path).stem: c for c in group.configs}
    assert all(c.rank_cost is not None for c in by.values())
    assert not any(n.startswith("recovery ") for n in by["good"].notes), by["good"].notes
    assert "recovery failed: RuntimeError: unexpected pos 20192109440 vs 20192109336" in by["failed"].notes
    assert "recovery diverged at step 3 (loss differs by 0.01)" in by["diverged"].notes
    out = subprocess.run([sys.executable, "-m", "capture", "decide", str(tmp_path / "runs"),
                          "--allowed-signers", str(tmp_path / "runs" / "allowed_signers")],
                         capture_output=True, text=True, env=dict(os.environ, COLUMNS="100"))
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "recovery failed: RuntimeError: unexpected pos" in text and "recovery diverged at step 3" in text


def test_cost_arithmetic_matches_the_manifests_own_figures(corpus):
    folder, paths, bodies = corpus
    groups, _ = _decide(folder)
    cpu = next(c for c in groups[0].configs if Path(c.run.path).name == "cpu.toml")
    cost = bodies["cpu"]["trial"]["cost"]
    assert cpu.price.per_device_hour == 2.0 and cpu.price.source == "manifest (--price-per-hour)"
    assert cpu.cost.trial_cost == pytest.approx(cost["trial_cost"], rel=1e-12)
    assert cpu.cost.trial_cost_per_million_trained_tokens == pytest.approx(cost["cost_per_million_trained_tokens"],
                                                                           rel=1e-12)
    assert cpu.tokens_per_s == bodies["cpu"]["trial"]["stats"]["tokens_per_s"]
    assert cpu.cost_to_target == pytest.approx(cpu.time_to_target_s / 3600 * 2.0)
    assert cpu.cost.steady_cost_per_million_tokens == pytest.approx(2.0 / 3600 / cpu.tokens_per_s * 1e6)
    ddp = next(c for c in groups[0].configs if c.strategy == "ddp" and c.trusted)
    assert ddp.count == 2 and ddp.efficiency == 0.9 and ddp.recovery == "bit-exact"
    assert ddp.cost_to_target == pytest.approx(ddp.time_to_target_s / 3600 * 3.0 * 2)  # two devices
    # --price wins over the manifest's, and says so
    groups, _ = _decide(folder, prices={"H200": 5.0})
    ddp = next(c for c in groups[0].configs if c.strategy == "ddp" and c.trusted)
    assert ddp.price.per_device_hour == 5.0 and ddp.price.source == "--price H200=5"


def test_committed_h200_run_projects_as_the_trial_did():
    """The H200 llama-1b run recorded its own projection to 1e9 tokens at 3.5/h: decide agrees."""
    runs, files = open_all([H200_RUN])
    assert files[0].state == "ok" and files[0].principal == "capture-project"
    (group,) = decide(runs, load_catalog(), {})
    (c,) = group.configs
    d = runs[0].data["trial"]["cost"]
    assert c.target_tokens == d["projection"]["target_tokens"] == 1_000_000_000
    assert c.time_to_target_s == pytest.approx(d["projection"]["total_s"], rel=1e-12)
    assert c.cost_to_target == pytest.approx(d["projection"]["cost"], rel=1e-12)
    assert c.cost.trial_cost_per_million_trained_tokens == pytest.approx(d["cost_per_million_trained_tokens"], rel=1e-12)
    assert c.tokens_per_s == runs[0].data["trial"]["stats"]["tokens_per_s"]
    assert c.rank_cost == 1
    untested = {u.name: u for u in group.untested}
    assert set(untested) == {"A100 80GB SXM", "H100 80GB SXM", "MI300X 192GB"}
    assert all(u.fits and "estimate" in u.basis and "no speed figures" in u.basis for u in untested.values())


def test_noise_rule():
    assert significant(100.0, 110.0, 0.02, 0.03) is True  # 10 % > 5 %
    assert significant(100.0, 104.0, 0.02, 0.03) is False
    assert significant(100.0, 104.0, None, 0.03) is None


def test_cli_json_text_and_usage_errors(corpus, capsys):
    folder, paths, _ = corpus
    assert main(["decide", str(folder), "--allowed-signers", str(folder / "allowed_signers"), "--json",
                 "--target-tokens", "2000000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["definition"]["method"] for g in doc["groups"]] == ["full", "lora"]
    untested = doc["groups"][0]["untested_cards"]
    assert untested and all(set(u) == {"name", "memory_bytes", "fits_estimate", "basis"} for u in untested)
    assert all(c["target_tokens"] == 2_000_000 for c in doc["groups"][0]["configurations"])
    assert main(["decide", str(folder), "--allowed-signers", str(folder / "allowed_signers")]) == 0
    text = capsys.readouterr().out
    assert "UNSIGNED" in text and "INVALID" in text and "MALFORMED" in text
    assert "None" not in text
    assert main(["decide", str(folder / "nope")]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["decide", str(folder), "--price", "H200"]) == 2
    assert "CARD=PRICE" in capsys.readouterr().err
    assert main(["decide", str(folder), "--allowed-signers", str(folder / "missing")]) == 2
    assert "--allowed-signers" in capsys.readouterr().err


def test_nothing_to_rank_says_so_under_the_answer(tmp_path, capsys):
    (tmp_path / "broken.toml").write_bytes(b"\xff\xfe[trial]\n")
    (tmp_path / "half.toml").write_text("[trial\n")
    assert main(["decide", str(tmp_path)]) == 0  # malformed files are reported in the output (docs/decide.md)
    lines = capsys.readouterr().out.splitlines()
    answer = lines.index("The answer")
    assert lines[answer + 1] == "  nothing ranked: none of the 2 file(s) holds a trial run (Files says why)"
    assert "\n".join(lines).count("MALFORMED") == 2
    assert main(["decide", str(tmp_path), "-o", str(tmp_path / "site")]) == 0
    page = (tmp_path / "site" / "index.html").read_text()
    answer = page[page.index('<h2 id="answer">'):page.index("</ul>", page.index('<h2 id="answer">'))]
    assert "<li>nothing ranked: none of the 2 file(s) holds a trial run (Files says why)</li>" in answer


def _site(corpus, tmp_path) -> Path:
    folder, _, _ = corpus
    site = tmp_path / "site"
    assert main(["decide", str(folder), str(MANIFESTS), "--allowed-signers", str(folder / "allowed_signers"),
                 "-o", str(site), "--price", "H200=3.5"]) == 0
    return site


def test_site_is_self_contained_and_matches_the_manifests(corpus, tmp_path, capsys):
    site = _site(corpus, tmp_path)
    capsys.readouterr()
    index = (site / "index.html").read_text()
    assert "<script" not in index.lower() and " src=" not in index and "<link" not in index
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", index)
    for svg in re.findall(r"<svg.*?</svg>", index, re.S):
        ET.fromstring(svg)
    for label in ("projected cost to the target (USD)", "projected time to the target", "measured tokens/s",
                  "peak memory per device against the card&#x27;s capacity"):
        assert label in index
    assert "signature INVALID" in index and "NOT signed" in index and "malformed" in index
    pages = sorted(p.name for p in (site / "runs").iterdir())
    committed_trials = [p for p in MANIFESTS.rglob("*.toml")
                        if ".capture" not in p.parts and '\nkind = "trial"\n' in p.read_text()]
    assert len(committed_trials) >= 3
    assert len(pages) == 5 + len(committed_trials)  # the corpus trials (not the malformed file) + the committed H200 trials
    assert "None" not in index


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


def _console_errors(stderr: str) -> list[str]:
    """Lines chromium logs for the page's console (``INFO:CONSOLE:<line>] "..."``) or a page error."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (.ci/run installs Debian's chromium)")
def test_site_in_a_real_headless_browser(corpus, tmp_path, capsys):
    site = _site(corpus, tmp_path)
    capsys.readouterr()
    # the console check is not vacuous: a page with a script is refused by the CSP, and that is seen
    bad = tmp_path / "bad.html"
    bad.write_text((site / "index.html").read_text().replace("</body>", "<script>console.error('x')</script></body>"))
    assert _console_errors(_chromium(tmp_path, "--dump-dom", bad.as_uri()).stderr)

    dom = _chromium(tmp_path, "--dump-dom", (site / "index.html").as_uri())
    assert dom.returncode == 0 and not _console_errors(dom.stderr), dom.stderr[-2000:]
    # the ranking the site was built from: the corpus and the committed manifests, as in _site
    runs, _ = open_all(expand([str(corpus[0]), str(MANIFESTS)]), trust=str(corpus[0] / "allowed_signers"))
    groups = decide(runs, load_catalog(), {"H200": 3.5}, None)
    first_table = dom.stdout.split('<table class="ranked">', 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", r, re.S) for r in re.findall(r"<tr[^>]*>(.*?)</tr>", first_table, re.S)[1:]]
    strip = lambda cell: re.sub(r"<[^>]+>", "", cell)  # noqa: E731
    col = COLUMNS.index
    assert [strip(r[col("configuration")]) for r in rows] == [c.label for c in groups[0].configs]
    assert [strip(r[col("run")]) for r in rows] == [c.run_id for c in groups[0].configs]
    assert [strip(r[0]) for r in rows] == [str(c.rank_cost) if c.rank_cost else "-" for c in groups[0].configs]
    assert [strip(r[col("signature")]) for r in rows] == [c.run.file.state for c in groups[0].configs]
    cpu_row = next(r for r, c in zip(rows, groups[0].configs) if Path(c.run.path).name == "cpu.toml")
    assert strip(cpu_row[col("tokens/s")]) == number_str(corpus[2]["cpu"]["trial"]["stats"]["tokens_per_s"])
    run_page = _chromium(tmp_path, "--dump-dom", next((site / "runs").iterdir()).as_uri())
    assert run_page.returncode == 0 and not _console_errors(run_page.stderr)
    assert 'aria-label="verdict"' in run_page.stdout

    # the layout at 1,280 px and the README's picture: tests/test_decide_site_layout.py


def test_this_repositorys_own_manifests_render(tmp_path, capsys):
    """Real data: every manifest committed in ../manifests, H200 runs of other work included as they land."""
    site = tmp_path / "site"
    assert main(["decide", str(MANIFESTS), "-o", str(site), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    on_disk = sorted(str(p) for p in MANIFESTS.rglob("*.toml") if ".capture" not in p.parts)
    assert sorted(f["path"] for f in doc["files"]) == on_disk
    assert all(f["state"] == "ok" for f in doc["files"])  # signed by the project's trusted keys
    trials = [f for f in doc["files"] if f["kind"] == "trial"]
    assert sorted(p.stem for p in (site / "runs").iterdir()) == sorted(f["content_id"] for f in trials)
    ranked = [c for g in doc["groups"] for c in g["configurations"] if c.get("rank_cost") or c.get("rank_time")]
    assert len(ranked) == len(trials)  # every trusted trial with measured tokens/s is ranked in its group
    unpriced = [c for g in doc["groups"] for c in g["configurations"] if "price_per_device_hour" not in c]
    assert unpriced and all("rank_cost" not in c and "projected_cost" not in c for c in unpriced)  # no cost, no #cost
    index = (site / "index.html").read_text()
    for f in doc["files"]:
        assert f["path"] in index


def test_price_sources_in_order_flag_catalog_manifest(tmp_path):
    catalog = tmp_path / "accelerators.toml"
    catalog.write_text('[[accelerator]]\nname = "H200 141GB"\nvendor = "nvidia"\nmatch = "H200(?! NVL)"\n'
                       f"memory_bytes = {H200_BYTES}\nprice_per_hour = 4.25\n")
    runs, _ = open_all([H200_RUN])
    projection = runs[0].data["trial"]["cost"]["projection"]
    (g,) = decide(runs, load_catalog(catalog), {})
    (c,) = g.configs
    assert c.price.per_device_hour == 4.25 and c.price.source == f"catalog ({catalog}): H200 141GB"
    assert c.cost_to_target == pytest.approx(projection["total_s"] / 3600 * 4.25)
    (g,) = decide(runs, load_catalog(catalog), {"H200 141GB": 2.0})
    assert g.configs[0].price.source == "--price H200 141GB=2"
    (g,) = decide(runs, load_catalog(), {})
    assert g.configs[0].price.source == "manifest (--price-per-hour)" and g.configs[0].price.per_device_hour == 3.5
