"""One error hierarchy; every error knows its exit code and the fix to suggest.

Exit codes (shared/DESIGN.md): 0 ok, 1 drift, 2 usage, 3 malformed manifest, 4 signature/trust;
and, for the commands that run checks, 5 a preflight check failed, 6 an artifact failed verification.
The CLI catches :class:`CaptureError` in one place and prints ``error: <message>`` and
``hint: <hint>`` on stderr; nothing else ever reaches the user as a traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_DRIFT = 1
EXIT_USAGE = 2
EXIT_MALFORMED = 3
EXIT_SIGNATURE = 4
EXIT_PREFLIGHT = 5
"""`capture preflight` (and the trial's preflight stage) found a check that failed."""
EXIT_ARTIFACT = 6
"""`--verify-artifacts`: a model or dataset file does not match its recorded id."""


class CaptureError(Exception):
    """Base class. ``exit_code`` decides the process exit status."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def diagnostics(self) -> str:
        """One line naming the problem, then (optionally) one line naming the fix.

        Messages quote files (names, principals, values): control characters are escaped, so a
        message is exactly one line and cannot rewrite the terminal.
        """
        from capture._escape import printable

        text = f"error: {printable(self.message)}"
        if self.hint:
            text += f"\nhint: {printable(self.hint)}"
        return text


class UsageError(CaptureError):
    """Bad flags or arguments, bad key files, bad config values (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A trial config or policy file is wrong; the message names the key to fix (exit 2)."""


class KeyError_(UsageError):
    """A signing key cannot be used: missing, unreadable, wrong permissions, wrong type (exit 2)."""


class ManifestError(CaptureError):
    """The manifest cannot be read or is malformed (exit 3)."""

    exit_code = EXIT_MALFORMED


class NotAManifest(ManifestError):
    """A file with no manifest header (no ``schema_version`` line, no ``[signature]`` table), met
    while walking a folder: a tree run lists it as skipped, exit 0 (a trial config kept beside
    manifests); named alone it is malformed (exit 3)."""


class SignatureError(CaptureError):
    """Not signed, signature invalid, body tampered, or signer not trusted (exit 4)."""

    exit_code = EXIT_SIGNATURE
    state = "invalid"
    """The report status this refusal stands for (``invalid``, ``unsigned`` or ``untrusted``)."""


class UnsignedError(SignatureError):
    """The manifest has no ``[signature]`` trailer (exit 4)."""

    state = "unsigned"


class TrustError(SignatureError):
    """The signature is valid but the signer is not in the allowed-signers file (exit 4)."""

    state = "untrusted"


class PreflightFailed(CaptureError):
    """A preflight health or performance check failed: not the machine that was paid for (exit 5)."""

    exit_code = EXIT_PREFLIGHT


class ArtifactMismatch(CaptureError):
    """A model or dataset file's bytes do not match its recorded blob id (exit 6)."""

    exit_code = EXIT_ARTIFACT


class DockerUnavailable(UsageError):
    """No Docker daemon (or no GPU runtime) where one is needed (exit 2)."""
