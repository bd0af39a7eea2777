"""Where capture keeps and finds its files: one place for the config folder and what lives in it."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/capture`` when that is an absolute path, else ``~/.config/capture``."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "capture"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub resolves it (without importing it):
    ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE`` (its older name), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"
