"""One cost vocabulary and one target across every reader, and terminal output that fits.

Real data: the H200 manifests committed in ../manifests (trusted through manifests/.capture/allowed_signers)
and one real `capture trial --example tiny` on this CPU, made with ``--target-tokens 1e6`` (the flag
as people write it). Each terminal check runs at ``COLUMNS=100`` and reads the output line by line.
"""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import pytest

from capture import costs
from capture import manifest as mf
from capture._cli import main
from capture.decide.rank import decide
from capture.decide.runs import open_all, run_definition
from capture.decide.text import DROP_ORDER, row
from capture.fmt import seconds_str
from capture.results.summary import summarize
from capture.trial.fit import load_catalog
from test_results_helpers import Signer

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
DAY = MANIFESTS / "nvidia-h200-x1" / "2026-12-02"
H200_A = DAY / "ff69c22bd470.toml"  # llama-1b, full, no recovery
H200_B = DAY / "0d455e463c23.toml"  # the same run definition, with preflight and recovery
TRUST = MANIFESTS / ".capture" / "allowed_signers"
WIDTH = 100


@pytest.fixture(scope="module")
def cpu_run(tiny_cpu_trial):
    """A real tiny trial on this CPU (tests/conftest.py), with its own target of 1e6 tokens."""
    data = mf.parse_body(mf.split_signed(tiny_cpu_trial.path.read_bytes())[0])
    assert data["trial"]["cost"]["projection"]["target_tokens"] == 1_000_000  # `1e6` was taken as written
    return tiny_cpu_trial.path, tiny_cpu_trial.allowed, data


@pytest.fixture
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    return WIDTH


def _fits(text: str, width: int = WIDTH) -> list[str]:
    lines = text.splitlines()
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, "\n".join(too_long)
    return lines


def _tokens(text: str) -> set[str]:
    return set(text.split())


# --------------------------------------------------------------------------- one target


def test_mixed_targets_are_ranked_on_one_target(cpu_run, tmp_path, capsys):
    """A run made with --target-tokens 1e6 and one made without are ranked on the same target."""
    _, _, data = cpu_run
    signer = Signer(tmp_path, "alice@lab")
    (tmp_path / "allowed_signers").write_text(signer.allowed_line)
    slow_own_target = copy.deepcopy(data)  # its own projection: 1e6 tokens, minutes
    fast_no_target = copy.deepcopy(data)  # as made without --target-tokens: no projection, 1.6x the tokens/s
    del fast_no_target["trial"]["cost"]["projection"]
    stats = fast_no_target["trial"]["stats"]
    stats["tokens_per_s"] *= 1.6
    stats["step_time_mean_s"] /= 1.6
    stats["step_time_median_s"] /= 1.6
    signer.write(tmp_path / "slow.toml", slow_own_target)
    signer.write(tmp_path / "fast.toml", fast_no_target)
    runs, _ = open_all([tmp_path / "slow.toml", tmp_path / "fast.toml"], trust=str(tmp_path / "allowed_signers"))
    (group,) = decide(runs, load_catalog(), {})
    by_name = {Path(c.run.path).name: c for c in group.configs}
    assert {c.target for c in group.configs} == {costs.Target(costs.DEFAULT_TARGET_TOKENS, "the default target")}
    slow, fast = by_name["slow.toml"], by_name["fast.toml"]
    assert fast.rank_time == 1 and slow.rank_time == 2 and fast.rank_cost == 1  # the faster run first, on both
    own = slow_own_target["trial"]["cost"]["projection"]["total_s"]
    assert slow.time_to_target_s != pytest.approx(own)  # its own 1e6-token projection is not mixed in
    expected = costs.figures(slow_own_target, target=costs.default_target())
    assert slow.time_to_target_s == pytest.approx(expected.projected_time_s, rel=1e-12)
    # the command's target, written as people write it, for every configuration
    assert main(["decide", str(tmp_path), "--allowed-signers", str(tmp_path / "allowed_signers"), "--json",
                 "--target-tokens", "2e9"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["targets"] == [{"tokens": 2_000_000_000, "source": "--target-tokens"}]
    assert {c["target_tokens"] for g in doc["groups"] for c in g["configurations"]} == {2_000_000_000}
    with pytest.raises(SystemExit) as stop:  # argparse's usage error: exit 2, one line and a hint
        main(["decide", str(tmp_path), "--target-tokens", "1.5"])
    assert stop.value.code == 2 and "whole number of tokens" in capsys.readouterr().err


# --------------------------------------------------------------------------- one vocabulary


def test_every_reader_shows_the_same_three_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # nothing wrapped: the figures are read as whole strings
    data = mf.parse_body(mf.split_signed(H200_A.read_bytes())[0])
    fig = costs.figures(data)
    assert fig.price is not None and fig.projection is not None and fig.target.tokens == costs.DEFAULT_TARGET_TOKENS
    cur = fig.currency
    cells = [costs.money_str(fig.trial_cost), costs.money_str(fig.steady_cost_per_million_tokens),
             costs.money_str(fig.projected_cost), seconds_str(fig.projected_time_s)]
    texts = [t for _, t in fig.texts()]
    assert all(name in dict(fig.texts()) for name in costs.NAMES)

    # decide: terminal (the run's row), --json, the site (row and run page)
    assert main(["decide", str(H200_A), "--allowed-signers", str(TRUST), "--wide"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "ff69c22bd470" in x and x.startswith("1 "))  # its table row
    assert all(f" {c} " in f" {line} " for c in cells), line
    assert f"Every cost in {cur}" in out
    assert main(["decide", str(H200_A), "--allowed-signers", str(TRUST), "--json"]) == 0
    (c,) = json.loads(capsys.readouterr().out)["groups"][0]["configurations"]
    assert (c["trial_cost"], c["steady_cost_per_million_tokens"], c["projected_cost"], c["projected_time_s"]) == \
        pytest.approx((fig.trial_cost, fig.steady_cost_per_million_tokens, fig.projected_cost, fig.projected_time_s))
    assert c["currency"] == cur and c["target_tokens"] == fig.target.tokens
    site = tmp_path / "site"
    assert main(["decide", str(H200_A), "--allowed-signers", str(TRUST), "-o", str(site)]) == 0
    capsys.readouterr()
    index = (site / "index.html").read_text()
    assert all(f">{html.escape(x)}</td>" in index for x in cells)
    page = (site / "runs" / "ff69c22bd470.html").read_text()
    assert all(html.escape(t) in page for t in texts)

    # show (terminal and --json), the trial report, compare, the index
    assert main(["show", str(H200_A), "--allowed-signers", str(TRUST)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert all(t in shown for t in texts)
    assert main(["show", str(H200_A), "--allowed-signers", str(TRUST), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)["summary"]["costs"]
    assert (j["trial_cost"], j["projected_cost"]) == pytest.approx((fig.trial_cost, fig.projected_cost))
    from capture.trial.report import render_html

    assert all(html.escape(t) in render_html(data) for t in texts)
    main(["compare", str(H200_A), str(H200_A), "--allowed-signers", str(TRUST)])
    compared = capsys.readouterr().out.splitlines()
    for name, value in ((costs.TRIAL_COST, fig.trial_cost), (costs.STEADY_COST, fig.steady_cost_per_million_tokens),
                        ("projected cost to the target", fig.projected_cost)):
        figure_line = next(x for x in compared if x.strip().startswith(name))
        assert figure_line.count(costs.money_str(value, cur)) == 2, figure_line
    from capture.results.index import render_markdown

    md = render_markdown([summarize(data, H200_A.read_bytes(), "x.toml").to_json()]).decode()
    assert costs.money_str(fig.trial_cost, cur) in md and costs.money_str(fig.projected_cost, cur) in md


# --------------------------------------------------------------------------- within 100 columns


def test_why_a_cost_is_missing_is_said_once_where_the_three_figures_stand_together():
    """An unpriced run said "no price: give --price (decide) or ..." after each of the three figures
    and again in the Cost section's heading: six times in one report. Now once, at the first figure
    it leaves out (terminal panel, Cost section, show), and the others read "not priced"."""
    from capture.trial import report

    data = mf.parse_body(mf.split_signed(H200_A.read_bytes())[0])
    fig = costs.figures(data, price=None)
    assert fig.note and fig.trial_cost is None and fig.projection is not None
    texts = dict(fig.texts())
    assert texts[costs.TRIAL_COST] == f"not priced ({fig.note})"
    assert texts[costs.STEADY_COST] == "not priced"
    assert texts[costs.PROJECTED].endswith("; no cost") and fig.note not in texts[costs.PROJECTED]
    assert all(fig.note not in t for _, t in fig.texts(note=False))
    data["trial"]["cost"].pop("price_per_hour", None)
    assert costs.figures(data).note == fig.note
    text = report.render_terminal(data, colour=False, width=400)
    assert text.count(fig.note) == 2, text  # the panel once, the Cost section once


def test_decide_fits_100_columns_and_breaks_no_word(cpu_run, columns, capsys):
    out_path, trust, _ = cpu_run
    assert main(["decide", str(MANIFESTS), str(out_path)]) == 0
    text = capsys.readouterr().out
    lines = _fits(text)
    assert lines[0].startswith("Target: 1,000,000,000 tokens (the default target)")
    assert lines.index("The answer") < next(i for i, x in enumerate(lines) if x.startswith("Group 1: "))
    answers = [x for x in lines if x.startswith("  Group ")]
    runs, _ = open_all([*sorted(MANIFESTS.rglob("*.toml")), out_path])
    groups = decide(runs, load_catalog(), {})
    assert len(answers) == len(groups)
    tokens = _tokens(text)
    kept = ("#cost", "#time", "configuration", "run", "trial cost", "steady cost / M tokens", "cost to target",
            "time to target", "signature")
    from capture.decide.text import COLUMNS

    for g in groups:
        for c in g.configs:
            cells = row(c)
            for name in kept:  # never left out, never cut inside a word
                for word in cells[COLUMNS.index(name)].split():
                    assert word in tokens, (name, word)
    left_out = next(x for x in lines if x.startswith("left out at 100 columns: "))
    named = left_out.removeprefix("left out at 100 columns: ").split(" (--wide")[0].split(", ")
    assert named == list(DROP_ORDER[:len(named)])  # in the documented order


def test_compare_h200_with_h200_fits_and_agrees_on_noise(columns, capsys):
    assert main(["compare", str(H200_A), str(H200_B), "--allowed-signers", str(TRUST)]) == 1
    text = capsys.readouterr().out
    lines = _fits(text)
    assert text.index("Trial figures") < text.index("Stack:")
    verdict = {x.split()[0]: x.rstrip() for x in lines if x.startswith(("  tokens/s", "  MFU"))}
    assert verdict["tokens/s"].endswith("within noise") and verdict["MFU"].endswith("within noise")
    assert "--all" in text


def test_compare_h200_with_cpu_fits_and_never_calls_rss_better(cpu_run, columns, capsys):
    out_path, trust, _ = cpu_run
    main(["compare", str(H200_B), str(out_path), "--allowed-signers", str(trust), "--allow-unsigned"])
    text = capsys.readouterr().out
    lines = _fits(text)
    assert len(lines) < 150  # the stack is summarised: no page of packages before the figures
    assert text.index("Trial figures") < text.index("Stack:")
    memory = " ".join(x for x in lines[lines.index("Trial figures (B relative to A)"):] if "peak memory" in x
                      or "RSS" in x or "NVML" in x)
    assert "device memory (NVML)" in memory and "host RSS" in memory
    assert "better" not in memory and "worse" not in memory and "not comparable" in memory
    packages = next(x for x in lines if x.strip().startswith("packages: "))
    assert re.fullmatch(r"  packages: \d+ changed, \d+ added, \d+ removed", packages)
    assert any(x.split()[:1] == ["torch"] for x in lines)  # the components that matter, side by side
    # --all: every difference, each line still within the width
    main(["compare", str(H200_B), str(out_path), "--allowed-signers", str(trust), "--all"])
    assert len(_fits(capsys.readouterr().out)) > len(lines)


def test_compare_of_two_run_definitions_says_why_once_and_leads_with_what_differs(columns, capsys):
    """QLoRA against LoRA on one H100 (both pinned here): the seven figures that cannot be compared
    said "not comparable: different run definitions (see ...)" each, wrapped over four lines (28
    lines); the differing fields were cut at their start ("trial.run.training.quantization.…"),
    hiding which key differed, and the one that matters (method nf4 -> none) was past the listed
    eight. Now the reason is one line under the table, field paths keep their end, and the run
    definition comes first, changed values before keys only one side has."""
    h100 = MANIFESTS / "nvidia-h100-80gb-hbm3-x1" / "2026-12-06"
    main(["compare", str(h100 / "13704c81bf7e.toml"), str(h100 / "057803b995e1.toml"), "--allowed-signers", str(TRUST)])
    lines = _fits(capsys.readouterr().out)
    table = lines[lines.index("Trial figures (B relative to A)"):lines.index("Stack: what changed from A to B")]
    assert sum("different run definitions" in x for x in table) == 1
    assert [x.split()[-2:] for x in table if x.startswith("  tokens/s")] == [["not", "comparable"]]
    fields = lines[next(i for i, x in enumerate(lines) if x.startswith("  other fields: ")) + 1:]
    assert fields[0].split()[:4] == ["trial.run.name", "qlora-gc", "->", "lora-gc"]
    assert fields[1].split()[0].endswith(".quantization.method") and fields[1].split()[1:] == ["nf4", "->", "none"]
    assert any(x.split()[0] == "….training.quantization.blocksize" for x in fields[:12])


def test_show_fits_and_keeps_check_names_whole(columns, capsys):
    assert main(["show", str(H200_B), "--allowed-signers", str(TRUST)]) == 0
    text = capsys.readouterr().out
    _fits(text)
    data = mf.parse_body(mf.split_signed(H200_B.read_bytes())[0])
    tokens = _tokens(text)
    checks = [c["name"] for c in data["preflight"]["checks"]]
    assert "ecc_aggregate_uncorrected" in checks
    assert all(name in tokens for name in checks)
    assert all(name in tokens for name in ("sw_power_cap", "remapped_rows"))
    assert re.search(r"projection to 1,000,000,000 tokens", text)  # the projection as a table


# --------------------------------------------------------------------------- docs


def test_docs_state_the_drop_order_and_the_distribution_name():
    decide_md = " ".join((ROOT / "docs" / "decide.md").read_text().split())
    assert "left out in this order: **" + ", ".join(DROP_ORDER) + "**" in decide_md
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").glob("*.py"),
                 *(ROOT / "capture").rglob("*.py")]:
        text = path.read_text()
        assert not re.search(r"\bcapture\[[a-z,]+\]", text), f"{path}: the distribution is capture-stack"


def test_catalog_currency_labels_every_figure_and_guards_prices(tmp_path, capsys):
    catalog = tmp_path / "eur.toml"
    catalog.write_text('currency = "EUR"\n')
    assert load_catalog(catalog).currency == "EUR"
    runs, _ = open_all([H200_A], trust=str(TRUST))
    (g,) = decide(runs, load_catalog(catalog), {})  # a manifest that records no currency: the catalog's
    assert g.configs[0].cost.currency == "EUR" and g.configs[0].rank_cost == 1
    (g,) = decide(runs, load_catalog(catalog), {}, currency="GBP")  # ... is not a GBP price
    (c,) = g.configs
    assert c.cost.currency == "GBP" and c.cost_to_target is None and c.rank_cost is None and c.rank_time == 1
    assert any("in EUR, not GBP" in n for n in c.notes)
    (g,) = decide(runs, load_catalog(catalog), {"H200": 3.2}, currency="GBP")  # --price is in the decision's
    assert g.configs[0].cost.currency == "GBP" and g.configs[0].rank_cost == 1
    assert main(["decide", str(H200_A), "--allowed-signers", str(TRUST), "--currency", "GBP", "--price", "H200=3"]) == 0
    assert "Every cost in GBP" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("currency = 5\n")
    assert main(["decide", str(H200_A), "--catalog", str(bad)]) == 2
    assert "currency" in capsys.readouterr().err


def test_run_definition_is_every_recorded_setting():
    base = {"trial": {"run": {"method": "full", "max_seq_len": 128, "device": "cuda:0", "seed": 1,
                              "model": {"architecture": "llama", "transformers_version": "5.0"}}}}
    same = copy.deepcopy(base)
    same["trial"]["run"].update(device="cpu", seed=7, measured_steps=3)  # the trial, not the run
    same["trial"]["run"]["model"]["transformers_version"] = "5.1"
    assert run_definition(same) == run_definition(base)
    for setting in ({"gradient_checkpointing": True}, {"compile": {"mode": "max-autotune"}},
                    {"quantization": {"bits": 4}}, {"micro_batch_size": 4}):  # a setting a newer trial records
        other = copy.deepcopy(base)
        other["trial"]["run"].update(setting)
        assert run_definition(other) != run_definition(base)
        key = next(iter(setting))
        assert any(d.startswith(key) for d in run_definition(other).differences(run_definition(base)))


def test_a_groups_heading_names_the_settings_that_make_the_run_fit():
    """Two groups of one model, method and batch read apart: QLoRA and LoRA on one H100 (pinned
    here) were both "llama (...) · lora · bf16 · seq 2048 · 8192 tokens/step"."""
    h100 = MANIFESTS / "nvidia-h100-80gb-hbm3-x1" / "2026-12-06"
    labels = {}
    for name in ("13704c81bf7e", "057803b995e1"):
        data = mf.parse_body(mf.split_signed((h100 / f"{name}.toml").read_bytes())[0])
        labels[name] = run_definition(data).label()
    assert labels["13704c81bf7e"].split(" · ")[1:] == ["lora r16", "nf4", "checkpointing", "sdpa", "bf16", "seq 2048",
                                                      "8192 tokens/step"]
    assert labels["057803b995e1"].split(" · ")[1:] == ["lora r16", "checkpointing", "sdpa", "bf16", "seq 2048",
                                                      "8192 tokens/step"]
    run = {"trial": {"run": {"method": "full", "max_seq_len": 8192, "optimizer": {"name": "paged_adamw_8bit"},
                             "model": {"architecture": "llama", "attn_implementation": "flash_attention_2"},
                             "training": {"compile": {"enabled": True}, "loss": {"name": "chunked"},
                                          "gradient_checkpointing": {"enabled": False},
                                          "quantization": {"method": "none"}}}}}
    assert run_definition(run).fit_words() == ["flash_attention_2", "compiled", "chunked loss", "paged_adamw_8bit"]


def test_termtable_fits_every_width_without_breaking_a_word():
    from capture.termtable import Column, fit

    cols = [Column("#", drop=None), Column("configuration", "config", min_width=12),
            Column("tokens/s", "tok/s", drop=2, nowrap=True), Column("recovery", drop=1),
            Column("cost to target", "to target", nowrap=True), Column("notes")]
    rows = [["1", "H200 141GB x1 single", "65,275", "skipped: --no-recovery", "16.17", "tokens/s within noise of #1"],
            ["2", "NVIDIA RTX PRO 6000 Blackwell Server Edition x8 fsdp", "1,234,567", "bit-exact", "1,009",
             "noisy: step-time CV 69.3 % (above 5 %)"]]
    words = {w for r in rows for c in r for w in c.split()}
    for width in range(40, 161, 7):
        t = fit(cols, rows, width)
        assert all(len(line) <= width for line in t.lines), width
        tokens = {w for line in t.lines for w in line.split()}
        shown = words - {w for i, c in enumerate(cols) if c.header in t.dropped for r in rows for w in r[i].split()}
        assert shown <= tokens, (width, shown - tokens)
        assert t.dropped == ["recovery", "tokens/s"][:len(t.dropped)]  # lowest drop first
    wide = fit(cols, rows, 40, wide=True)
    assert any(rows[1][1] in line for line in wide.lines) and not wide.dropped


def test_cut_keeps_the_start_or_the_end():
    from capture.termtable import cut

    assert cut("trial.run.training.quantization.method", 20) == "trial.run.training.…"
    assert cut("trial.run.training.quantization.method", 20, keep_end=True) == "…quantization.method"
    assert cut("short", 20, keep_end=True) == "short" and cut("abc", 1, keep_end=True) == "…"
    assert all(len(cut("x" * 50, w, keep_end=True)) == w for w in range(1, 50))
