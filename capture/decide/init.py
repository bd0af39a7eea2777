"""`capture init DIR`: a results repository that is easy to start and keeps itself honest.

Writes ``.capture/results.toml`` (layout 1, what `capture pin` files by), ``allowed_signers``
with the given public key, a README stub and, with ``ci=True``, the GitHub Actions workflow and a
pre-commit hook from ``capture/data/templates``; runs ``git init`` when DIR is in no git work tree;
commits exactly those files. An existing results repository is refused, leaving it as it was.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from capture import __version__
from capture._atomic import atomic_write
from capture.errors import UsageError

RESULTS_TOML = """\
# This folder is a capture results repository: `capture pin FILE --repo .` files signed manifests
# here, `capture verify . --signature-only` checks all of them, `capture decide . -o site` ranks them.
# layout 1: <accelerator-slug>/<YYYY-MM-DD>/<first 12 hex of sha256(file)>.toml, index.json, index.md
layout = 1
"""


@dataclass(frozen=True)
class InitResult:
    root: Path
    written: tuple[str, ...]
    commit: str | None


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UsageError("git is not installed", "install git; a results repository is a git repository") from None


def _template(name: str, dir_in_repo: str) -> str:
    text = (resources.files("capture") / "data" / "templates" / name).read_text(encoding="utf-8")
    return text.replace("@DIR@", dir_in_repo).replace("@VERSION@", __version__)


def _public_key_line(key: str | os.PathLike[str] | None, principal: str | None) -> str:
    from capture.signing import default_key_path

    path = Path(key) if key else Path(str(default_key_path()) + ".pub")
    if path.suffix != ".pub" and Path(str(path) + ".pub").is_file():
        path = Path(str(path) + ".pub")
    try:
        fields = path.read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        raise UsageError(f"--key: cannot read the public key {path}",
                         "name a KEY.pub written by `capture keygen` (or run it first)") from None
    if len(fields) < 2 or fields[0] != "ssh-ed25519":
        raise UsageError(f"--key: {path} is not an ssh-ed25519 public key", "name a KEY.pub written by `capture keygen`")
    who = principal or (fields[2] if len(fields) > 2 else None)
    if not who or any(c.isspace() for c in who):
        raise UsageError(f"--principal: {path} names no principal", "pass --principal NAME (e.g. you@lab)")
    return f"{who} {fields[0]} {fields[1]}\n"


def init_repository(directory: str | os.PathLike[str], key: str | os.PathLike[str] | None = None,
                    principal: str | None = None, ci: bool = False) -> InitResult:
    target = Path(directory)
    if (target / ".capture" / "results.toml").exists():
        raise UsageError(f"{target}: already a results repository (.capture/results.toml exists)",
                         f"pin into it: `capture pin FILE --repo {target}`")
    signer_line = _public_key_line(key, principal)  # before anything is written
    target.mkdir(parents=True, exist_ok=True)
    top = _git(target, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        made = _git(target, "init", "-q")
        if made.returncode != 0:
            raise UsageError(f"{target}: git init failed ({made.stderr.strip()})", "check the folder's permissions")
        top = _git(target, "rev-parse", "--show-toplevel")
    root = Path(top.stdout.strip())
    rel = os.path.relpath(target.resolve(), root.resolve())
    in_repo = "." if rel == "." else rel.replace(os.sep, "/")
    files: dict[Path, tuple[str, int | None]] = {
        target / ".capture" / "results.toml": (RESULTS_TOML, None),
        target / "allowed_signers": (signer_line, None),
    }
    if not (target / "README.md").exists():
        files[target / "README.md"] = (_template("README.md", in_repo), None)
    if ci:
        files[root / ".github" / "workflows" / "capture.yml"] = (_template("github-workflow.yml", in_repo), None)
        files[root / ".githooks" / "pre-commit"] = (_template("pre-commit", in_repo), 0o755)
    for path, (text, mode) in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text.encode("utf-8"), mode=mode)
    names = [os.path.relpath(p, root) for p in files]
    add = _git(root, "add", "--", *names)
    if add.returncode != 0:
        raise UsageError(f"git add failed: {add.stderr.strip()}", "check the repository")
    # --no-verify: this commit holds no manifest, and the hook it installs needs capture on PATH
    done = _git(root, "commit", "-q", "--no-verify", "-m", "capture init: results repository, trusted signers",
                "--", *names)
    if done.returncode != 0:
        raise UsageError(f"git commit failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'unknown'}",
                         "set your identity (`git config user.name ...`, `git config user.email ...`) and commit "
                         "the files listed above")
    if ci:
        _git(root, "config", "core.hooksPath", ".githooks")
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    return InitResult(root, tuple(names), head or None)
