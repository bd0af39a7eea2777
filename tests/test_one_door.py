"""The one door: only capture/verify/open.py parses manifest content; no import circle in the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "capture"

BODY_PARSERS = {"parse_body", "parse_trailer", "load_unverified"}
"""capture.manifest's parsers of manifest bytes."""
ALLOWED_BODY_PARSE = {
    "verify/open.py": "the door",
    "manifest.py": "defines the parsers",
    "signing/trailer.py": "parse_trailer inside signature verification (steps 1-6, called by the door); "
                          "parse_body on the body `capture sign` is about to sign (not signed content)",
}
ALLOWED_TOML_LOADS = {
    "manifest.py": "the parser the door calls",
    "verify/policy.py": "policy files (not manifests)",
    "trial/config.py": "trial configs (not manifests)",
    "trial/fit.py": "the accelerator catalog (not manifests)",
    "redact.py": "trial configs, to record them without comments (not manifests)",
    "image/locks.py": "pyproject.toml and uv's pylock output (not manifests)",
    "preflight/catalog.py": "the preflight figures per SKU (not manifests)",
    "results/pin.py": ".capture/results.toml (layout setting, not a manifest)",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _called_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else ""
                names.add(f"{base}.{f.attr}" if base else f.attr)
                names.add(f.attr)
    return names


def test_only_the_door_parses_manifest_content():
    offenders = []
    for rel, tree in _modules():
        called = _called_names(tree)
        if called & BODY_PARSERS and rel not in ALLOWED_BODY_PARSE:
            offenders.append(f"{rel}: calls {sorted(called & BODY_PARSERS)}")
        toml = {c for c in called if c in ("tomllib.loads", "tomli.loads", "tomllib.load", "tomli.load")}
        if toml and rel not in ALLOWED_TOML_LOADS:
            offenders.append(f"{rel}: calls {sorted(toml)}")
    assert offenders == [], "only capture/verify/open.py may parse manifest content:\n" + "\n".join(offenders)


def test_commands_open_manifests_through_the_door():
    """Each reading command's module reaches open_manifest (directly or through verify/results)."""
    uses = {rel for rel, tree in _modules() if "open_manifest" in _called_names(tree)}
    for rel in ("verify/single.py", "verify/tree.py", "verify/compare.py", "results/compare.py",
                "results/show.py", "results/intoto.py", "results/pin.py", "commands/core.py"):
        assert rel in uses, rel


def _imports(rel: str, tree: ast.Module) -> set[str]:
    """Modules imported at import time (top level, not inside functions: those cannot form a cycle at import)."""
    out = set()
    me = "capture." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("capture"):
            out.add(node.module)
            for a in node.names:
                out.add(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("capture"))
    out.discard(me)
    return out


def test_no_import_circle_in_the_package():  # module-level imports; a deferred import is no circle
    mods = {"capture." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): _imports(rel, t)
            for rel, t in _modules()}
    graph = {m: {d for d in deps if d in mods and d != m} for m, deps in mods.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_file_over_600_lines_in_the_package():
    for p in PACKAGE.rglob("*.py"):
        assert len(p.read_text().splitlines()) < 600, p
