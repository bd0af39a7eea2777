"""Children that must not outlive capture: Linux's ``prctl(PR_SET_PDEATHSIG)``.

A capture process killed by SIGKILL (the kernel's out-of-memory killer, ``kill -9``, a container
stopped hard) runs no clean-up, so a child it started would go on alone: a recovery worker holding
device memory, torchrun and its ranks training on, a command ``capture exec`` records with no one
to record it. Each such child asks the kernel for a signal when its parent dies. The kernel sends it
when the *thread* that started the child ends, so children are started from the main thread.
Elsewhere than Linux the call does not exist and nothing changes (the catchable signals are still
handled by their parents).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """The C library's ``prctl``; None where there is none (not Linux)."""
    try:
        import ctypes

        return cast(Callable[..., int], ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        return None


def request(signum: int) -> bool:
    """Ask for ``signum`` when this process's parent dies; False where the platform cannot."""
    prctl = _prctl()
    return prctl is not None and int(prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0


def preexec(signum: int, exit_code: int) -> Callable[[], None]:
    """For ``subprocess.Popen(preexec_fn=...)``, run in the child between fork and exec: the request,
    then exit with ``exit_code`` if the parent (this process, when called) is already gone, since
    the signal would then never come. The C library is opened here, in the parent, so that the
    child only makes the call."""
    parent = os.getpid()
    prctl = _prctl()

    def setup() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(exit_code)
    return setup
