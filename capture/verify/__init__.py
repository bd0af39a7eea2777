"""The verify wing: one door to open a manifest, one engine to compare two stacks.

- :mod:`capture.verify.open`: :func:`open_manifest`, the only place a manifest is read, verified
  and parsed (:class:`OpenedManifest`, :class:`SignatureStatus`).
- :mod:`capture.verify.policy`: which fields make "the same stack" (default, ``--strict``,
  policy files, the review policy of `capture compare`).
- :mod:`capture.verify.compare`: :func:`flatten`, :func:`compare_manifests`, :class:`Difference`.
- :mod:`capture.verify.single`: `verify FILE` and :func:`judge`, the verdict every manifest gets.
- :mod:`capture.verify.tree`: `verify DIR | GLOB | FILE...`.
"""

from capture.verify.compare import ABSENT, CodeChanges, Difference, code_changes, compare_manifests, diff_files, flatten
from capture.verify.open import OpenedManifest, SignatureStatus, load_allowed, open_manifest
from capture.verify.policy import ALWAYS_IGNORED, DEFAULT_COMPARE, STRICT_COMPARE, Policy, Rule
from capture.verify.single import LiveStack, Verdict, format_report, judge, verify_file

VerifyReport = Verdict

__all__ = [
    "ABSENT", "ALWAYS_IGNORED", "DEFAULT_COMPARE", "STRICT_COMPARE", "CodeChanges", "Difference", "LiveStack",
    "OpenedManifest", "Policy", "Rule", "SignatureStatus", "Verdict", "VerifyReport", "code_changes",
    "compare_manifests", "diff_files", "flatten", "format_report", "judge", "load_allowed", "open_manifest",
    "verify_file",
]
