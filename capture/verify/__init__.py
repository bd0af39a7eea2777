"""STAND-IN (helper `decide`), replaced by helper `door`'s capture/verify/ package at merge.

It only makes ``capture.verify`` a package so that ``capture.verify.open`` imports on this
branch, and re-exports today's ``capture/verify.py`` unchanged.
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

_spec = _ilu.spec_from_file_location("capture._verify_module", _Path(__file__).parent.parent / "verify.py")
assert _spec is not None and _spec.loader is not None
_module = _ilu.module_from_spec(_spec)
_sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
