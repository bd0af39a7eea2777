"""Planted credentials (tests/fixtures/planted/credentials.json, every class of issue 17 finding 7)
reach no manifest, report, log or export: through the real probes (a real git repository whose
remote holds them, a real pip-installed distribution whose direct_url.json holds them, allowlisted
environment variables), a real `capture fingerprint` + `capture export --format in-toto`, and a
real `capture trial` on the CPU with a config whose comments and values hold them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from capture import manifest, redact
from capture.probes import ProbeOptions, code, environment, packages

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "planted" / "credentials.json").read_text())
CASES = [tuple(c) for c in FIXTURE["cases"]]
URL_CASES = [c for c in CASES if c[1] == "url"]
TEXT_CASES = [c for c in CASES if c[1] == "text"]
CONFIG_KEYS = [tuple(c) for c in FIXTURE["config_keys"]]
ARGV_CASES = [(tuple(a), secret) for a, secret in FIXTURE["argv"]]
ALL_SECRETS = [c[3] for c in CASES] + [s for _, s in CONFIG_KEYS]
ARGV_SECRETS = [secret for _, secret in ARGV_CASES]
ENV_NAMES = ("XLA_FLAGS", "MASTER_ADDR", "MKL_VERBOSE", "NCCL_SOCKET_IFNAME", "TORCH_HOME", "PYTORCH_CUDA_ALLOC_CONF",
             "HF_ENDPOINT", "OMP_PLACES", "CUDA_CACHE_PATH", "TRITON_CACHE_DIR", "KMP_AFFINITY", "HF_HUB_ENABLE_HF_TRANSFER")
GIT_ENV = {"GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "T",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
CAPTURE = [sys.executable, "-m", "capture"]


def _ids(cases: list[tuple]) -> list[str]:
    return [f"{c[0]}-{c[3]}" for c in cases]


def _leaks(blob: str | bytes) -> list[str]:
    text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
    return [s for s in ALL_SECRETS if s in text]


def test_the_corpus_covers_every_class() -> None:
    classes = {c[0] for c in CASES}
    assert {"userinfo", "fragment", "query", "path", "bare-userinfo", "unparsable", "free-text", "shape"} <= classes
    assert len(CASES) + len(CONFIG_KEYS) >= 72 and len(ARGV_CASES) >= 16
    for key in ("sig", "key", "pwd", "jwt", "ticket", "pat", "X-Goog-Signature"):
        assert any(f"?{key}=" in c[2] or f"&{key}=" in c[2] for c in URL_CASES), key


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_the_module_removes_each_case(case: tuple) -> None:
    _cls, kind, value, secret = case
    assert secret not in redact.redact_text(value)
    if kind == "url":
        assert secret not in redact.redact_url(value)


@pytest.mark.parametrize(("value", "kept"), [
    ("https://github.com/org/repo.git", "https://github.com/org/repo.git"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
    ("ssh://git@github.com/org/repo.git", "ssh://git@github.com/org/repo.git"),
    ("https://host/x?ref=main#readme", "https://host/x?ref=main#readme"),
    ("https://files.example.org/packages/ab/cd/" + "0f" * 32 + "/torch-2.13.0-cp311-none-any.whl",
     "https://files.example.org/packages/ab/cd/" + "0f" * 32 + "/torch-2.13.0-cp311-none-any.whl"),
    ("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_autotune_level=4",
     "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_autotune_level=4"),
    ("expandable_segments:True,max_split_size_mb:512", "expandable_segments:True,max_split_size_mb:512"),
    ("GPU-260c4f31-7270-c299-6b83-dea31efee481", "GPU-260c4f31-7270-c299-6b83-dea31efee481"),
    ("10.0.0.5", "10.0.0.5"),
    ('tokenizer = "bytes"', 'tokenizer = "bytes"'),
    ("https://files.example.org/p/PyYAML-6.0.1-cp311-cp311-manylinux_2_17_x86_64.whl",
     "https://files.example.org/p/PyYAML-6.0.1-cp311-cp311-manylinux_2_17_x86_64.whl"),
    ("https://github.com/org/MyProject2023ReleaseBuild.git", "https://github.com/org/MyProject2023ReleaseBuild.git"),
])
def test_what_is_not_a_credential_is_kept(value: str, kept: str) -> None:
    assert redact.redact_text(value) == kept


@pytest.mark.parametrize(("args", "secret"), ARGV_CASES, ids=[s for _, s in ARGV_CASES])
def test_a_recorded_command_line_loses_each_credential(args: tuple, secret: str) -> None:
    argv = ["tool", "--verbose", *args, "--lr", "0.1", "out.bin"]
    recorded = redact.redact_argv(argv)
    assert secret not in " ".join(recorded)
    assert recorded[:2] == ["tool", "--verbose"] and recorded[-3:] == ["--lr", "0.1", "out.bin"]
    assert len(recorded) == len(argv)  # nothing dropped or merged: the command keeps its shape


@pytest.mark.parametrize("argv", [
    ["python", "-u", "train.py", "--max-new-tokens", "100", "--tokenizer", "gpt2"],
    ["torchrun", "--nproc-per-node", "8", "--passes", "3", "--bypass-cache", "x", "--num-tokens", "5"],
    ["curl", "-o", "out", "https://host/x?ref=main", "--user-agent", "me"],
    ["tool", "--auth", "--verbose"],  # a switch named auth takes no value
    ["tool", '{"lr": 0.1, "steps": [1, 2]}', "lr=0.1", "model=meta-llama/Llama-3.2-1B"],
])
def test_a_command_line_without_credentials_is_recorded_as_given(argv: list[str]) -> None:
    assert redact.redact_argv(argv) == argv


@pytest.mark.parametrize(("key", "secret"), CONFIG_KEYS)
def test_a_config_value_under_a_credential_key_is_withheld(key: str, secret: str) -> None:
    text = f'[trial.model.config]\n{key} = "{secret}"  # {secret}\npad_token = "<pad>"\n'
    out = tomllib.loads(redact.toml_without_comments(text))["trial"]["model"]["config"]
    assert out == {key: redact.REDACTED, "pad_token": "<pad>"}


def test_config_comments_are_removed_and_hashes_inside_strings_kept() -> None:
    text = '[trial]  # c1\nname = "a#b"  # c2\n# c3\nm = """x # y\n"""\nv = [\n  "p", # c4\n]\nt = \'q#r\'\n'
    out = redact.toml_without_comments(text)
    assert "c1" not in out and "c2" not in out and "c3" not in out and "c4" not in out
    assert tomllib.loads(out) == tomllib.loads(text)


# --------------------------------------------------------------------------- the real probes


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], env={**os.environ, **GIT_ENV}, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("code") / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('train')\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "first")
    _git(root, "remote", "add", "origin", URL_CASES[0][2])
    for i, case in enumerate(URL_CASES[1:12]):
        _git(root, "remote", "add", f"mirror{i:02d}", case[2])
    return root


@pytest.mark.parametrize("case", URL_CASES, ids=_ids(URL_CASES))
def test_git_remote(repo: Path, case: tuple) -> None:
    _git(repo, "remote", "set-url", "origin", case[2])
    info = code.probe(ProbeOptions(code=repo))
    assert isinstance(info, code.CodeInfo), info
    body = manifest.dumps({**manifest.new_manifest(), "code": info.to_manifest()})
    assert case[3] not in body.decode() and info.remote_name == "origin"


def _wheel(folder: Path) -> Path:
    import base64
    import hashlib
    import zipfile

    files = {"plantpkg/__init__.py": b"", "plantpkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: plantpkg\nVersion: 1.0\n",
             "plantpkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                     for n, d in files.items()) + "plantpkg-1.0.dist-info/RECORD,,\n"
    path = folder / "plantpkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("plantpkg-1.0.dist-info/RECORD", record)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip installs a real wheel (it writes direct_url.json); one copy of its dist-info per URL case,
    each with the case's URL as its origin, as pip writes it for a direct URL install."""
    base = tmp_path_factory.mktemp("site")
    target = base / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(target), str(_wheel(base))], check=True, capture_output=True)
    real = target / "plantpkg-1.0.dist-info"
    written = json.loads((real / "direct_url.json").read_text())
    assert set(written) >= {"url", "archive_info"}
    for i, case in enumerate(URL_CASES):
        dist = target / f"plant{i:02d}-1.0.dist-info"
        shutil.copytree(real, dist)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: plant{i:02d}\nVersion: 1.0\n")
        origin = {"url": case[2], "vcs_info": {"vcs": "git", "commit_id": "0" * 40}} if i % 2 else {**written, "url": case[2]}
        (dist / "direct_url.json").write_text(json.dumps(origin))
    return target


def test_pip_origins(site: Path) -> None:
    info = packages.probe(ProbeOptions(), path=[str(site)])
    names = {p.name for p in info.packages}
    assert "plantpkg" in names and len(names) == len(URL_CASES) + 1
    body = manifest.dumps({**manifest.new_manifest(), "python": info.to_manifest()}).decode()
    assert _leaks(body) == []
    assert all(p.url for p in info.packages if p.name.startswith("plant"))


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_allowlisted_variables(case: tuple) -> None:
    env = {name: case[2] for name in ENV_NAMES}
    info = environment.probe(ProbeOptions(), env=env)
    assert set(info.variables) | set(info.redacted) == set(ENV_NAMES)
    body = manifest.dumps({**manifest.new_manifest(), "environment": info.to_manifest()}).decode()
    assert case[3] not in body


# --------------------------------------------------------------------------- the real commands


def _planted_env(tmp_path: Path, site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPTURE_", "XLA_", "MKL_"))}
    env.update(GIT_ENV)
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    for i, case in enumerate(CASES):
        env[f"{ENV_NAMES[i % len(ENV_NAMES)].split('_')[0]}_PLANT_{i:02d}"] = case[2]
    env["XLA_FLAGS"] = TEXT_CASES[0][2]
    env["MASTER_ADDR"] = "alice:BareUserinfo01@10.0.0.5"
    env["MKL_VERBOSE"] = TEXT_CASES[2][2]
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CAPTURE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_real_exec_records_no_planted_credential(tmp_path: Path, site: Path) -> None:
    """`capture exec` runs a real command whose arguments hold every planted argv case: the signed
    manifest, stdout and stderr hold none of them."""
    env = _planted_env(tmp_path, site)
    args = [a for argv, _ in ARGV_CASES for a in argv]
    out = tmp_path / "exec.toml"
    done = _run(["exec", "-o", str(out), "--no-report", "--", sys.executable, "-c", "import sys", *args], env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    body = out.read_bytes().decode()
    assert [s for s in ARGV_SECRETS if s in body + done.stdout + done.stderr] == []
    assert _leaks(body) == []
    data = tomllib.loads(manifest.split_signed(out.read_bytes())[0].decode())
    assert data["exec"]["command"][:3] == [sys.executable, "-c", "import sys"]
    assert len(data["exec"]["command"]) == 3 + len(args)


def test_fingerprint_and_in_toto_export(tmp_path: Path, repo: Path, site: Path) -> None:
    env = _planted_env(tmp_path, site)
    _git(repo, "remote", "set-url", "origin", URL_CASES[1][2])
    key = tmp_path / "id_ed25519"
    assert _run(["keygen", "-o", str(key), "-C", "t@example.invalid"], env, tmp_path).returncode == 0
    out = tmp_path / "fp.toml"
    done = _run(["fingerprint", "--code", str(repo), "--key", str(key), "-o", str(out), "--timings"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    body = out.read_bytes()
    assert _leaks(body) == [] and _leaks(done.stdout) == [] and _leaks(done.stderr) == []
    data = tomllib.loads(manifest.split_signed(body)[0].decode())
    assert "plantpkg" in data["python"]["packages"] and data["code"]["remote_name"] == "origin"
    assert "XLA_FLAGS" in data["environment"]["redacted"] or "XLA_FLAGS" in data["environment"]["variables"]
    exported = _run(["export", str(out), "--format", "in-toto", "--key", str(key)], env, tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert _leaks(exported.stdout) == [] and _leaks(exported.stderr) == []
    import base64

    payload = base64.b64decode(json.loads(exported.stdout)["payload"]).decode()
    assert _leaks(payload) == [] and "plantpkg" in payload


TINY_PLANTED = """\
[trial]
name = {name}
seed = 1234
warmup_steps = 1
measured_steps = 3
[trial.model]
source = "from_config"
architecture = "gpt2"
[trial.model.config]
vocab_size = 257
n_positions = 64
n_embd = 64
n_layer = 2
n_head = 2
bos_token_id = 256
eos_token_id = 256
[trial.batch]
max_seq_len = 64
micro_batch_size = 4
[trial.data]
source = "corpus"
tokenizer = "bytes"   # a tokenizer = "..." is no credential
{values}[trial.validation]
every_steps = 10
batches = 2
[trial.checkpoint]
every_steps = 20
[trial.recovery]
save_at_step = 1
total_steps = 2
"""


def _planted_config() -> str:
    comments = "".join(f"# {c[2]}\n".replace("\n", " ", c[2].count("\n")) for c in CASES)
    trailing = [f"  # {c[2]}" if "\n" not in c[2] else "" for c in CASES]
    # corpus data: text_field and files are read only for local and hub data, so every value can sit there
    values = f"text_field = {json.dumps(CASES[0][2])}\nfiles = [\n"
    values += "".join(f"  {json.dumps(c[2])},{trailing[i]}\n" for i, c in enumerate(CASES)) + "]\n"
    return comments + TINY_PLANTED.format(values=values, name=json.dumps("planted " + TEXT_CASES[5][2]))


def test_a_real_trial_records_no_planted_credential(tmp_path: Path, repo: Path, site: Path) -> None:
    """A real tiny trial (~25 s on the 2-core CPU): manifest, terminal report, HTML report, stderr
    and the in-toto export hold none of the planted values; the config is recorded without comments."""
    config = tmp_path / "planted.toml"
    config.write_text(_planted_config())
    assert _leaks(config.read_text()) == [c[3] for c in CASES]  # every one is planted
    env = _planted_env(tmp_path, site)
    _git(repo, "remote", "set-url", "origin", URL_CASES[2][2])
    out = tmp_path / "trial.toml"
    done = _run(["trial", str(config), "-o", str(out), "--code", str(repo)], env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    body = out.read_bytes()
    html = out.with_suffix(".html").read_text()
    assert _leaks(body) == [] and _leaks(html) == []
    assert _leaks(done.stdout) == [] and _leaks(done.stderr) == []
    data = tomllib.loads(manifest.split_signed(body)[0].decode())
    recorded = data["trial"]["config_toml"]
    assert redact.toml_without_comments(recorded, redact_strings=False) == recorded  # no comment is left
    assert "is no credential" not in recorded and "URL_CASES" not in recorded
    parsed = tomllib.loads(recorded)["trial"]
    assert parsed["data"]["tokenizer"] == "bytes" and len(parsed["data"]["files"]) == len(CASES)
    assert parsed["data"]["files"][7] == "https://Pw0rdUserOnly08@dev.azure.com/org/proj/_git/repo".replace(
        "Pw0rdUserOnly08@", "")  # what is around a credential stays
    key = tmp_path / "cfg" / "capture" / "id_ed25519"
    exported = _run(["export", str(out), "--format", "in-toto", "--key", str(key)], env, tmp_path)
    assert exported.returncode == 0, exported.stderr
    import base64

    assert _leaks(base64.b64decode(json.loads(exported.stdout)["payload"])) == []
