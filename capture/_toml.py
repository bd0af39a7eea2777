"""One way to read TOML from anywhere (manifests, configs, catalogs, policies, lock files).

tomllib (and tomli) raise ``TOMLDecodeError`` for bad syntax, but an integer of more than 4,300
digits escapes as a plain ``ValueError`` from ``int()`` (Python's limit on integer parsing) and a
deeply nested array as ``RecursionError``: a hostile file ended in a traceback. Here all three are
:class:`TomlError`, a ``ValueError`` with one readable line.
"""

from __future__ import annotations

import sys
from typing import Any


class TomlError(ValueError):
    """The text is not TOML this reader can take; ``str()`` is one line for an error message."""


def loads(text: str, parser: Any = None) -> dict[str, Any]:
    """``parser.loads(text)`` (``tomllib`` by default; the manifest passes the compiled tomli)."""
    if parser is None:
        import tomllib as parser
    try:
        data: dict[str, Any] = parser.loads(text)
        return data
    except RecursionError:
        raise TomlError("arrays or inline tables nested too deeply to read") from None
    except ValueError as exc:  # TOMLDecodeError is a ValueError; so is int()'s digit limit
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        if "integer string conversion" in first:
            first = f"an integer of more than {sys.get_int_max_str_digits():,} digits"
        raise TomlError(first) from None
