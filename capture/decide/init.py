"""`capture init DIR`: a results repository that is easy to start and keeps itself honest.

Writes ``.capture/results.toml`` (layout 1, what `capture pin` files by), ``.capture/allowed_signers``
with the given public key (the repository's trust root: docs/trust.md), a ``.gitignore`` for the
decision site, a README stub and, with ``ci=True``, the GitHub Actions workflow and a pre-commit
hook from ``capture/data/templates`` (``core.hooksPath``); runs ``git init`` when DIR is in no git
work tree; commits exactly those files.

Everything is checked before anything is written: the key, the folder, a git identity to commit
with, and that no existing trust file, workflow, hook or ``core.hooksPath`` would be replaced
(``force=True`` replaces them). If a step fails after that, what was written is taken back (files,
the staged entries, a repository ``git init`` made), so a second `init` starts from where the first
began.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
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
# Trust: .capture/allowed_signers in this folder, and no other file (docs/trust.md).
layout = 1
"""
GITIGNORE_LINE = "site/"
"""`capture decide . -o site` writes the decision site here; it is built, never committed."""
WORKFLOW = Path(".github/workflows/capture.yml")
HOOKS_DIR = ".githooks"
DIST_NAME = "capture-stack"
_SAFE_SPEC = re.compile(r"[A-Za-z0-9@:/._+=~ -]+")


@dataclass(frozen=True)
class InitResult:
    root: Path
    written: tuple[str, ...]
    commit: str | None
    install: str | None = None
    """The CI's install spec (with ``ci=True``)."""


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UsageError("git is not installed", "install git; a results repository is a git repository") from None


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def _template(name: str, replacements: dict[str, str]) -> str:
    text = (resources.files("capture") / "data" / "templates" / name).read_text(encoding="utf-8")
    for key, value in replacements.items():
        text = text.replace(key, value)
    return text


def _public_key_line(key: str | os.PathLike[str] | None, principal: str | None) -> str:
    """``PRINCIPAL ssh-ed25519 AAAA...``: the principal is --principal, else the one every other
    command signs with for this key (:func:`capture.signing.default_principal`: the key's comment,
    else user@hostname)."""
    from capture.signing import default_key_path, default_principal

    path = Path(key) if key else Path(str(default_key_path()) + ".pub")
    if path.suffix != ".pub" and Path(str(path) + ".pub").is_file():
        path = Path(str(path) + ".pub")
    from capture._safe_read import KEY_MAX_BYTES, read_regular

    try:
        fields = read_regular(path, KEY_MAX_BYTES, UsageError, "public key").decode("utf-8").split()
    except (OSError, UnicodeDecodeError):
        raise UsageError(f"--key: cannot read the public key {path}",
                         "name a KEY.pub written by `capture keygen` (or run it first)") from None
    if len(fields) < 2 or fields[0] != "ssh-ed25519":
        raise UsageError(f"--key: {path} is not an ssh-ed25519 public key", "name a KEY.pub written by `capture keygen`")
    private = Path(str(path)[:-4]) if str(path).endswith(".pub") else path
    who = principal or default_principal(private)
    if not who or any(c.isspace() or ord(c) < 0x20 for c in who):
        raise UsageError(f"--principal: {who!r} cannot be a principal (white space or control characters)",
                         "pass --principal NAME (e.g. you@lab)")
    from capture.signing.trust import _allowed_signers_line

    return _allowed_signers_line(who, f"{fields[0]} {fields[1]}") + "\n"


# --------------------------------------------------------------------------- how CI installs capture


def check_install_spec(spec: str) -> str:
    """``capture-stack==X.Y.Z`` or ``capture-stack @ git+URL@<40-hex commit>``; anything else is
    refused (exit 2): the bare name ``capture`` on the public index is an unrelated package."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(spec)
    except InvalidRequirement as exc:
        raise UsageError(f"--install {spec!r}: not a requirement ({exc})", f"e.g. {DIST_NAME}=={__version__}") from None
    ok_pin = not req.url and len(req.specifier) == 1 and next(iter(req.specifier)).operator == "=="
    ok_url = req.url is not None and req.url.startswith("git+") and re.search(r"@[0-9a-f]{40}$", req.url) is not None
    if req.name != DIST_NAME or not (ok_pin or ok_url) or req.extras or req.marker or not _SAFE_SPEC.fullmatch(spec):
        raise UsageError(f"--install {spec!r}: CI must install {DIST_NAME} at an exact version or at a git commit",
                         f"e.g. {DIST_NAME}=={__version__}, or {DIST_NAME} @ git+https://github.com/ORG/capture@<40-hex commit>")
    return spec


def install_spec() -> tuple[str, str | None]:
    """How this capture was installed, as CI can repeat it, and a note when it cannot be repeated
    exactly (an editable or local install: CI then installs the same version from the index)."""
    from importlib import metadata

    from capture import _json
    from capture.redact import redact_url

    version_spec = f"{DIST_NAME}=={__version__}"
    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        return version_spec, f"capture runs from a source tree here; CI installs {version_spec}"
    raw = dist.read_text("direct_url.json")
    if not raw:
        return f"{DIST_NAME}=={dist.version}", None
    try:
        origin = _json.loads(raw)
    except _json.JsonError:
        origin = {}
    vcs = origin.get("vcs_info") if isinstance(origin, dict) else None
    url = origin.get("url") if isinstance(origin, dict) else None
    if isinstance(vcs, dict) and vcs.get("vcs") == "git" and isinstance(url, str) \
            and re.fullmatch(r"[0-9a-f]{40}", str(vcs.get("commit_id", ""))) and redact_url(url) == url:
        spec = f"{DIST_NAME} @ git+{url}@{vcs['commit_id']}"
        if _SAFE_SPEC.fullmatch(spec):
            return spec, None
    return (f"{DIST_NAME}=={dist.version}",
            f"capture is installed from a local folder or archive here; CI installs {DIST_NAME}=={dist.version} "
            "(set the repository variable CAPTURE_INSTALL, or pass --install, if that is not what you use)")


# --------------------------------------------------------------------------- plan, check, write, commit


def _check_dir(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise UsageError(f"{target}: exists and is not a folder", "name a new or existing folder for the results repository")
    bad = [c for c in str(target) if ord(c) < 0x20 or ord(c) == 0x7F]
    if bad:
        raise UsageError(f"{target!r}: control characters in the path", "name a plain folder")


def _nearest_existing(path: Path) -> Path:
    p = path.resolve() if path.exists() else Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    return p


def _check_identity(where: Path) -> None:
    for what in ("GIT_AUTHOR_IDENT", "GIT_COMMITTER_IDENT"):
        done = _git(where, "var", what)
        if done.returncode != 0:
            raise UsageError(f"git has no {'author' if 'AUTHOR' in what else 'committer'} identity to commit with "
                             f"({_last_line(done)})",
                             'set one first: `git config --global user.name "..."` and `git config --global user.email ...`; '
                             "nothing was written")


class _Undo:
    """What init did, to take back if a later step fails."""

    def __init__(self) -> None:
        self.created: list[Path] = []
        self.replaced: dict[Path, bytes] = {}
        self.dirs: list[Path] = []
        self.git_dir: Path | None = None
        self.staged: tuple[Path, list[str]] | None = None

    def run(self) -> None:
        if self.staged is not None:
            root, names = self.staged
            if _git(root, "reset", "-q", "--", *names).returncode != 0:  # no commit yet: nothing to go back to
                _git(root, "rm", "-q", "--cached", "--ignore-unmatch", "--", *names)
        for path, data in self.replaced.items():
            atomic_write(path, data)
        for path in reversed(self.created):
            path.unlink(missing_ok=True)
        if self.git_dir is not None:
            shutil.rmtree(self.git_dir, ignore_errors=True)
        for d in reversed(self.dirs):
            try:
                d.rmdir()
            except OSError:
                pass


def _mkdirs(path: Path, undo: _Undo) -> None:
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
        undo.dirs.append(d)


def _hook_conflict(root: Path, force: bool) -> None:
    current = _git(root, "config", "--get", "core.hooksPath").stdout.strip()
    if current and current != HOOKS_DIR and not force:
        raise UsageError(f"{root}: core.hooksPath is already {current!r}; init would replace it with {HOOKS_DIR!r}",
                         f"add `capture verify DIR --signature-only --staged --trust-from HEAD` to your own hook, "
                         "or pass --force to replace the setting")


def init_repository(directory: str | os.PathLike[str], key: str | os.PathLike[str] | None = None,
                    principal: str | None = None, ci: bool = False, force: bool = False,
                    install: str | None = None) -> InitResult:
    target = Path(directory)
    _check_dir(target)
    if (target / ".capture" / "results.toml").exists() and not force:
        raise UsageError(f"{target}: already a results repository (.capture/results.toml exists)",
                         f"pin into it: `capture pin FILE --repo {target}` (or pass --force to write its files again)")
    signer_line = _public_key_line(key, principal)
    note = None
    if ci:
        spec, note = (check_install_spec(install), None) if install else install_spec()
    existing = _nearest_existing(target)
    _check_identity(existing)
    top = _git(existing, "rev-parse", "--show-toplevel")
    root = Path(top.stdout.strip()) if top.returncode == 0 else target.resolve() if target.exists() else Path(os.path.abspath(target))
    rel = os.path.relpath(os.path.abspath(target), root.resolve()) if top.returncode == 0 else "."
    in_repo = "." if rel == "." else rel.replace(os.sep, "/")

    files: dict[Path, tuple[str, int | None, bool]] = {  # path -> (text, mode, must not replace without --force)
        target / ".capture" / "results.toml": (RESULTS_TOML, None, False),
        target / ".capture" / "allowed_signers": (signer_line, None, True),
    }
    gitignore = target / ".gitignore"
    old_ignore = gitignore.read_text(encoding="utf-8", errors="replace") if gitignore.is_file() else None
    if old_ignore is None or GITIGNORE_LINE not in old_ignore.splitlines():
        text = (old_ignore or "") + ("" if not old_ignore or old_ignore.endswith("\n") else "\n") + \
            "# the decision site `capture decide . -o site` builds\n" + GITIGNORE_LINE + "\n"
        files[gitignore] = (text, None, False)
    if not (target / "README.md").exists():
        files[target / "README.md"] = (_template("README.md", {"@DIR@": in_repo}), None, False)
    if ci:
        quoted = shlex.quote(in_repo)
        files[root / WORKFLOW] = (_template("github-workflow.yml", {"@DIR@": quoted, "@INSTALL@": spec}), None, True)
        files[root / HOOKS_DIR / "pre-commit"] = (_template("pre-commit", {"@DIR@": quoted}), 0o755, True)
    for path, (text, _mode, guarded) in files.items():
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UsageError(f"{path}: exists and is not a regular file", "move it away, then run init again")
        if guarded and path.is_file() and not force and path.read_bytes() != text.encode("utf-8"):
            raise UsageError(f"{path}: already exists; init does not replace a trust file, workflow or hook",
                             "keep yours (add the lines you need by hand), or pass --force to replace it")
    if ci and top.returncode == 0:
        _hook_conflict(root, force)

    undo = _Undo()
    try:
        return _write_and_commit(target, root, top.returncode == 0, files, ci, spec if ci else None, note, undo)
    except BaseException:
        undo.run()
        raise


def _write_and_commit(target: Path, root: Path, in_git: bool, files: dict[Path, tuple[str, int | None, bool]],
                      ci: bool, spec: str | None, note: str | None, undo: _Undo) -> InitResult:
    _mkdirs(target, undo)
    if not in_git:
        made = _git(target, "init", "-q")
        if made.returncode != 0:
            raise UsageError(f"{target}: git init failed ({_last_line(made)})", "check the folder's permissions")
        undo.git_dir = target / ".git"
    for path, (text, mode, _guarded) in files.items():
        _mkdirs(path.parent, undo)
        if path.is_file():
            undo.replaced[path] = path.read_bytes()
        else:
            undo.created.append(path)
        atomic_write(path, text.encode("utf-8"), mode=mode)
    names = [os.path.relpath(os.path.abspath(p), os.path.abspath(root)) for p in files]
    undo.staged = (root, names)
    add = _git(root, "add", "--", *names)
    if add.returncode != 0:
        raise UsageError(f"git add failed: {_last_line(add)}", "check the repository; nothing was kept")
    # --no-verify: this commit holds no manifest, and the hook it installs needs capture on PATH
    done = _git(root, "commit", "-q", "--no-verify", "-m", "capture init: results repository, trusted signers",
                "--", *names)
    if done.returncode != 0:
        raise UsageError(f"git commit failed: {_last_line(done)}", "fix the cause and run init again; nothing was kept")
    undo.staged = None
    if ci:
        hooks = _git(root, "config", "core.hooksPath", HOOKS_DIR)
        if hooks.returncode != 0:
            sys.stderr.write(f"capture: warning: could not set core.hooksPath ({_last_line(hooks)}); "
                             f"run `git -C {root} config core.hooksPath {HOOKS_DIR}`\n")
    if note:
        sys.stderr.write(f"capture: note: {note}\n")
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    return InitResult(root, tuple(names), head or None, spec)

