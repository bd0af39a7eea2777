"""Where capture keeps and finds its files: one place for the config folder and what lives in it."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/capture`` when that is an absolute path, else ``~/.config/capture``."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "capture"
