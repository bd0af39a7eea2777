"""``capture exec``: fingerprint, run any command unchanged, then sign what happened.

The command runs in its own session and process group with capture's environment plus
``CAPTURE_EXEC_DIR`` (a private folder): SIGINT, SIGTERM and SIGHUP that reach capture are
forwarded to that process group, and capture waits for the command to end. Afterwards the
manifest records the command line (credentials redacted), the exit status (or the signal),
wall time, and the SHA-256 of every output path named with ``--output`` (files hashed in
parallel); a Recorder inside the command (any rank 0) adds its ``[trial]`` figures through the
side folder. Then it is signed. The exit status of ``capture exec`` is the command's.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.errors import UsageError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_CAPTURE_FAILED_AFTER = 125
"""The command succeeded but capture could not write the manifest afterwards."""

_CHUNK = 1 << 20


@dataclass(frozen=True)
class OutputHash:
    """One ``--output`` path after the command: a file's SHA-256, or a folder's tree digest
    (SHA-256 over ``"<sha256>  <relative path>\\n"`` lines in path order)."""

    path: str
    exists: bool
    kind: str = ""
    sha256: str = ""
    files: int = 0
    size_bytes: int = 0

    def to_manifest(self) -> dict[str, Any]:
        if not self.exists:
            return {"path": self.path, "exists": False}
        return {"path": self.path, "exists": True, "kind": self.kind, "sha256": self.sha256, "files": self.files,
                "size_bytes": self.size_bytes, "digest": "sha256 of each file; a folder: sha256 over '<sha256>  <path>' lines"}


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    manifest_path: Path | None
    wall_time_s: float
    signal_name: str | None = None
    recorder_joined: bool = False
    outputs: tuple[OutputHash, ...] = field(default_factory=tuple)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line as recorded: :func:`capture.redact.redact_argv` (the one redactor)."""
    from capture.redact import redact_argv as _redact

    return _redact(list(argv))


def _file_sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def hash_outputs(paths: Sequence[str | os.PathLike[str]], workers: int | None = None) -> list[OutputHash]:
    """Hash every file under ``paths`` with a thread pool (hashlib releases the GIL)."""
    jobs: list[tuple[int, str, Path]] = []
    kinds: list[tuple[str, bool, str]] = []
    for i, raw in enumerate(paths):
        p = Path(raw)
        if p.is_file():
            kinds.append((str(raw), True, "file"))
            jobs.append((i, p.name, p))
        elif p.is_dir():
            kinds.append((str(raw), True, "folder"))
            jobs += [(i, f.relative_to(p).as_posix(), f) for f in sorted(p.rglob("*")) if f.is_file()]
        else:
            kinds.append((str(raw), False, ""))
    with ThreadPoolExecutor(max_workers=workers or min(32, (os.cpu_count() or 1) + 4)) as pool:
        digests = list(pool.map(lambda job: _file_sha256(job[2]), jobs))
    out = []
    for i, (path, exists, kind) in enumerate(kinds):
        mine = [(rel, d) for (j, rel, _), d in zip(jobs, digests) if j == i]
        if not exists:
            out.append(OutputHash(path, False))
            continue
        if kind == "file":
            out.append(OutputHash(path, True, kind, mine[0][1][0], 1, mine[0][1][1]))
            continue
        tree = hashlib.sha256("".join(f"{d[0]}  {rel}\n" for rel, d in mine).encode("utf-8")).hexdigest()
        out.append(OutputHash(path, True, kind, tree, len(mine), sum(d[1] for _, d in mine)))
    return out


def _utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_output(folder: Path | None = None) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return (folder or Path.cwd()) / f"exec-{stamp}.toml"


def _check_before(argv: Sequence[str], output: Path, key: str | os.PathLike[str] | None) -> Path:
    """Everything that can fail on capture's side is checked before the command starts (exit 2)."""
    from capture import signing

    if not argv:
        raise UsageError("exec: no command given", "put the command after `--`: capture exec -o run.toml -- python train.py")
    if not output.parent.is_dir():
        raise UsageError(f"-o: folder {output.parent} does not exist", "create it first or choose another path")
    key_path = Path(key) if key else signing.ensure_default_key()
    signing.load_private_key(key_path)  # a missing or unusable key is an error now, not after a long run
    return key_path


def run_exec(argv: Sequence[str], output: Path | None = None, outputs: Sequence[str] = (),
             key: str | os.PathLike[str] | None = None, principal: str | None = None,
             report: bool = True, say: Callable[[str], None] | None = None) -> ExecResult:
    """Fingerprint, run ``argv``, record and sign. Returns the command's exit status (128+N for
    a command ended by signal N) and where the manifest went."""
    from capture.fingerprint import collect
    from capture.probes import ProbeOptions

    tell: Callable[[str], object] = say or (lambda msg: sys.stderr.write(f"capture: {msg}\n"))
    output = Path(output) if output else default_output()
    key_path = _check_before(argv, output, key)
    manifest = collect(ProbeOptions(progress=False), kind="trial")
    side = Path(tempfile.mkdtemp(prefix="capture-exec-"))
    env = dict(os.environ, CAPTURE_EXEC_DIR=str(side))
    started_utc, t0 = _utc(), time.perf_counter()
    try:
        try:
            child = subprocess.Popen(list(argv), env=env, start_new_session=True)
        except FileNotFoundError:
            sys.stderr.write(f"error: exec: command not found: {argv[0]}\nhint: check the name and PATH\n")
            return ExecResult(EXIT_NOT_FOUND, None, 0.0)
        except PermissionError:
            sys.stderr.write(f"error: exec: not executable: {argv[0]}\nhint: chmod +x it, or run it through its interpreter\n")
            return ExecResult(EXIT_NOT_EXECUTABLE, None, 0.0)
        returncode = _wait_forwarding(child)
        wall = time.perf_counter() - t0
        ended_utc = _utc()
        sig_name = signal.Signals(-returncode).name if returncode < 0 else None
        exit_code = 128 - returncode if returncode < 0 else returncode
        tell(f"command ended: {'signal ' + sig_name if sig_name else f'exit status {exit_code}'} after {wall:.1f} s")
        hashed = hash_outputs(outputs)
        from capture.integrations import exec_side

        tables = exec_side.collect(side)
    finally:
        shutil.rmtree(side, ignore_errors=True)
    redacted = redact_argv(argv)
    record: dict[str, Any] = {
        "command": redacted, "command_line": shlex.join(redacted), "cwd": os.getcwd(),
        "exit_code": exit_code, "succeeded": exit_code == 0, "wall_time_s": wall,
        "started_utc": started_utc, "ended_utc": ended_utc, "recorder_tables": len(tables),
        "outputs": [h.to_manifest() for h in hashed],
    }
    if sig_name:
        record["signal"] = sig_name
    manifest["exec"] = record
    manifest["kind"] = "trial" if tables else "fingerprint"  # a run with measured steps, or the stack and the command
    if tables:
        manifest["trial"] = tables[-1]
        manifest["trial"]["config_source"] = f"capture exec: {shlex.join(redacted)}"
    try:
        if tables and report:
            from capture.integrations.html import report_table

            manifest["trial"]["report"] = report_table(manifest, output.with_suffix(".html"))
        from capture import manifest as mf
        from capture import signing

        signing.write_signed(output, mf.dumps(manifest), key_path, principal)
    except Exception as exc:  # the command's status stands; say why there is no record
        sys.stderr.write(f"error: exec: the manifest was not written ({type(exc).__name__}: {exc})\n"
                         f"hint: the command's own outputs are untouched; fix the cause and run it again\n")
        return ExecResult(exit_code or EXIT_CAPTURE_FAILED_AFTER, None, wall, sig_name, bool(tables), tuple(hashed))
    return ExecResult(exit_code, output, wall, sig_name, bool(tables), tuple(hashed))


def _wait_forwarding(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child``, forwarding the signals in :data:`FORWARDED` to its process group."""

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # pragma: no cover - the handler above replaces SIGINT's default
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
