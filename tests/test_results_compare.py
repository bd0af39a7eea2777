"""`capture compare` and `capture show` on real signed manifests."""

from __future__ import annotations

import json

import pytest

from capture import manifest as mf
from capture._cli import main
from capture.results.compare import compare_files
from capture.results.show import load as show_load
from test_results_helpers import h200_manifest, keys  # noqa: F401


@pytest.fixture
def two_runs(tmp_path, keys):
    """Run B: torch downgraded, numpy changed, a package added and one removed, 12% fewer tokens/s."""
    trusted = tmp_path / "allowed_signers"
    trusted.write_text(keys["alice"].allowed_line)
    a = h200_manifest()
    b = h200_manifest(created_utc="2026-12-03T09:00:00Z")
    pkgs = b["python"]["packages"]
    gone = sorted(pkgs)[0]
    del pkgs[gone]
    pkgs["numpy"] = {"version": "1.26.4", "source": "index"}
    pkgs["flash-attn"] = {"version": "2.7.4", "source": "index"}
    b["framework"]["version"] = "2.10.0+cu128"
    b["nvidia"]["driver_version"] = b["accelerator"]["driver_version"] = "570.86.15"
    b["trial"]["stats"]["tokens_per_s"] = a["trial"]["stats"]["tokens_per_s"] * 0.88
    b["trial"]["stats"]["step_time_median_s"] = a["trial"]["stats"]["step_time_median_s"] / 0.88
    b["trial"]["recovery"]["verdict"] = "bit-exact"
    keys["alice"].write(tmp_path / "a.toml", a)
    keys["mallory"].write(tmp_path / "b.toml", b)
    return tmp_path / "a.toml", tmp_path / "b.toml", trusted, gone, a


def test_compare_names_figures_then_stack_changes(two_runs, capsys):
    pa, pb, trusted, gone, a = two_runs
    assert main(["compare", str(pa), str(pb), "--allowed-signers", str(trusted)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "signature valid, signer trusted by alice@lab" in lines[2]
    assert "signer NOT trusted" in lines[5] and "mallory@elsewhere" in lines[5]
    assert out.index("Trial figures") < out.index("Stack:")  # the figures first
    assert any(line.split()[:3] == ["torch", "2.11.0+cu130", "2.10.0+cu128"] for line in lines)  # what matters
    assert any(line.split()[:3] == ["driver", "580.159.04", "570.86.15"] for line in lines)
    assert any("packages: 1 changed, 1 added, 1 removed" in line for line in lines)
    assert any(line.split()[:4] == ["flash-attn", "(absent)", "->", "2.7.4"] for line in lines)  # a package that matters
    assert not any(line.split()[:1] == ["numpy"] for line in lines)  # ... the rest are counted, --all lists them
    assert "--all" in out and "--json" in out
    tok = next(line for line in lines if line.strip().startswith("tokens/s"))
    assert "64,113" in tok and "56,420" in tok and "-12.0%" in tok and tok.rstrip().endswith("worse")
    step = next(line for line in lines if line.strip().startswith("step time median"))
    assert "+13.6%" in step and step.rstrip().endswith("worse")
    rec = next(line for line in lines if line.strip().startswith("recovery"))
    assert "diverged at step 5" in rec and "bit-exact" in rec
    # --all: every difference with its whole value
    assert main(["compare", str(pa), str(pb), "--allowed-signers", str(trusted), "--all"]) == 1
    lines = capsys.readouterr().out.splitlines()
    numpy_now = a["python"]["packages"]["numpy"]["version"]
    assert any(line.split() == ["numpy:", numpy_now, "->", "1.26.4"] for line in lines)
    assert any(line.split()[:1] == [f"{gone}:"] and line.rstrip().endswith("(absent)") for line in lines)
    assert any("framework.version: 2.11.0+cu130 -> 2.10.0+cu128" in line for line in lines)


def test_compare_json(two_runs, capsys):
    pa, pb, trusted, gone, a = two_runs
    assert main(["compare", str(pa), str(pb), "--allowed-signers", str(trusted), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["a"]["signature"]["state"] == "ok" and doc["b"]["signature"]["state"] == "untrusted"
    assert {"group": "framework", "field": "framework.version", "a": "2.11.0+cu130", "b": "2.10.0+cu128"} in doc["stack"]
    assert {"name": "flash-attn", "version": "2.7.4"} in doc["packages"]["added"]
    assert [p["name"] for p in doc["packages"]["removed"]] == [gone]
    tok = next(f for f in doc["figures"] if f["name"] == "tokens_per_s")
    assert tok["relative_change"] == pytest.approx(-0.12) and tok["verdict"] == "worse"


def test_same_stack_is_exit_0_even_when_figures_differ(two_runs, tmp_path, keys, capsys):
    pa, _, trusted, _, a = two_runs
    c = compare_files(str(pa), str(pa), str(trusted))
    assert c.stack == () and not c.packages
    assert {f.verdict for f in c.figures} == {"same"}
    a["trial"]["stats"]["tokens_per_s"] *= 1.01
    keys["alice"].write(tmp_path / "again.toml", a)
    assert main(["compare", str(pa), str(tmp_path / "again.toml")]) == 0
    assert "Stack: same" in capsys.readouterr().out


def test_compare_reads_tampered_and_unsigned_but_says_so(two_runs, tmp_path):
    pa, pb, trusted, _, _ = two_runs
    tampered = tmp_path / "t.toml"
    tampered.write_bytes(pa.read_bytes().replace(b"580.159.04", b"580.159.99"))
    unsigned = tmp_path / "u.toml"
    unsigned.write_bytes(mf.split_signed(pb.read_bytes())[0])
    c = compare_files(str(tampered), str(unsigned), str(trusted))
    assert c.a.signature.state == "invalid" and "INVALID" in c.a.signature.label
    assert c.b.signature.state == "unsigned"
    assert any(ch.field == "nvidia.driver_version" and ch.a == "580.159.99" for ch in c.stack)


@pytest.mark.parametrize("content, match", [
    (b'schema_version = 1\nkind = "trial"\ncreated_utc = "2026', "not valid TOML"),
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b'kind = "trial"\n', "no schema_version"),
])
def test_malformed_is_exit_3(two_runs, tmp_path, capsys, content, match):
    pa = two_runs[0]
    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    assert main(["compare", str(pa), str(bad)]) == 3
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert main(["show", str(bad)]) == 3


def test_show_summary(two_runs, capsys):
    pa, _, trusted, _, _ = two_runs
    assert main(["show", str(pa), "--allowed-signers", str(trusted)]) == 0
    out = capsys.readouterr().out
    assert "signature    signature valid, signer trusted by alice@lab" in out
    assert "accelerator  NVIDIA H200 x1 (140.40 GiB each)" in out
    assert "framework    torch 2.11.0+cu130, cuDNN 91900, NCCL/RCCL 2.28.9" in out
    assert "meta-llama/Llama-3.2-1B@4e20de362430" in out
    # the trial part: the trial report's table, or the fallback table, both with the figures
    assert "64,113" in out and "diverged at step 5" in out


def test_show_json_and_fingerprint(tmp_path, keys, capsys):
    m = h200_manifest(kind="fingerprint")
    keys["alice"].write(tmp_path / "fp.toml", m)
    assert main(["show", str(tmp_path / "fp.toml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["kind"] == "fingerprint" and "tokens_per_s" not in doc["summary"]
    assert doc["signature"]["state"] in ("untrusted", "ok")
    shown = show_load(str(tmp_path / "fp.toml"))
    assert shown.summary.accelerator_slug == "nvidia-h200-x1"


def test_model_built_from_config_is_named_by_type(tmp_path, keys):
    """As `capture trial --example tiny` records it: no [[models]], a [trial.run.model] without a repo."""
    m = h200_manifest()
    del m["models"]
    m["trial"]["run"]["model"] = {"architecture": "gpt2", "model_type": "gpt2", "source": "from_config",
                                  "weights": "none (random init from config, seeded)"}
    keys["alice"].write(tmp_path / "tiny.toml", m)
    assert show_load(str(tmp_path / "tiny.toml")).summary.models == ("gpt2 (from_config)",)


def test_a_change_within_the_runs_noise_is_not_called_better(tmp_path, keys, capsys):
    """The rule: significant only when |B - A| / A > CV_A + CV_B (docs/decide.md)."""
    trusted = tmp_path / "allowed_signers"
    trusted.write_text(keys["alice"].allowed_line)
    a, b = h200_manifest(), h200_manifest(created_utc="2026-12-03T09:00:00Z")
    a["trial"]["stats"]["step_time_cv"] = 0.02
    b["trial"]["stats"]["step_time_cv"] = 0.08  # noisy
    b["trial"]["stats"]["tokens_per_s"] = a["trial"]["stats"]["tokens_per_s"] * 1.05  # 5 % < 2 % + 8 %
    b["trial"]["stats"]["step_time_median_s"] = a["trial"]["stats"]["step_time_median_s"] * 0.5  # 50 % > 10 %
    keys["alice"].write(tmp_path / "a.toml", a)
    keys["alice"].write(tmp_path / "b.toml", b)
    c = compare_files(str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), trusted)
    fig = {f.name: f for f in c.figures}
    assert fig["tokens_per_s"].verdict == "within noise" and fig["tokens_per_s"].significant is False
    assert fig["step_time_median_s"].verdict == "better" and fig["step_time_median_s"].significant is True
    assert fig["peak_memory_bytes"].significant is None
    main(["compare", str(tmp_path / "a.toml"), str(tmp_path / "b.toml"), "--allowed-signers", str(trusted)])
    out = capsys.readouterr().out
    assert "step-time CV: A 2.00 %, B 8.00 %" in out
    assert "B: step-time CV 8.0 % is high (above 5 %)" in out
    tok = next(line for line in out.splitlines() if line.strip().startswith("tokens/s"))
    assert tok.rstrip().endswith("within noise")


def test_compare_shows_preflight_figures_side_by_side():
    # the two committed H200 preflight runs (--quick, then --full): every check aligned by name and device
    from pathlib import Path

    from capture.results.compare import compare_files, render

    folder = Path(__file__).resolve().parent.parent / "manifests"
    quick, full = (folder / "nvidia-h200-x1" / "2026-12-02" / f"{cid}.toml" for cid in ("ebe1678e8e9f", "e09239ef73d8"))
    c = compare_files(str(quick), str(full), folder / "allowed_signers")
    gemm = next(r for r in c.preflight if r["name"] == "gemm_bf16")
    assert gemm["device"] == 0 and gemm["unit"] == "TFLOP/s" and gemm["verdict_a"] == gemm["verdict_b"] == "pass"
    assert gemm["ratio"] == pytest.approx(gemm["b"] / gemm["a"])
    text = render(c)
    assert "Preflight (B relative to A)" in text and "gemm_bf16 (device 0)" in text
    assert c.to_json()["preflight"][0]["name"] == c.preflight[0]["name"]
