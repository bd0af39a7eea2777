"""One way to read JSON that capture did not write itself (a tool's output, an environment value,
a results repository's index, a user's data file).

``json.loads`` raises ``JSONDecodeError`` for bad syntax, but an integer of more than 4,300 digits
escapes as a plain ``ValueError`` whose text tells the reader to call
``sys.set_int_max_str_digits()``, and deep nesting as ``RecursionError``: hostile input ended in a
traceback or in Python's advice. Here all three are :class:`JsonError`, a ``ValueError`` whose
``str()`` is one readable line, with the line of the text it points at where known (the
counterpart of :mod:`capture._toml`).
"""

from __future__ import annotations

import json
import sys
from typing import Any


class JsonError(ValueError):
    """The text is not JSON this reader can take. ``reason``: one line; ``lineno``: 1-based, or None."""

    def __init__(self, reason: str, lineno: int | None = None) -> None:
        super().__init__(reason)
        self.reason, self.lineno = reason, lineno


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonError(f"{exc.msg} at line {exc.lineno}, column {exc.colno}", exc.lineno) from None
    except RecursionError:
        raise JsonError("arrays or objects nested too deeply to read") from None
    except UnicodeDecodeError:
        raise JsonError("not UTF-8 text") from None
    except ValueError:  # int()'s digit limit: the only other ValueError json.loads raises
        raise JsonError(f"an integer of more than {sys.get_int_max_str_digits():,} digits") from None
