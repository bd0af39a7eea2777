"""Where capture keeps and finds its files: one place for the config folder, the default key, the
personal allowed-signers file and the hub cache. Everything is read from the environment at call
time, so a flag or a test that sets a variable takes effect."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/capture`` when that is an absolute path, else ``~/.config/capture``."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "capture"


def default_key_path() -> Path:
    """The signing key: ``$CAPTURE_KEY``, else ``config_dir()/id_ed25519``."""
    env = os.environ.get("CAPTURE_KEY", "")
    if env:
        return Path(env).expanduser()
    return config_dir() / "id_ed25519"


def personal_allowed_signers() -> Path:
    """The user's own allowed-signers file, ``config_dir()/allowed_signers`` (may not exist); the
    last place :func:`capture.signing.trust.find_allowed_signers` looks, and where the default
    key's public half is trusted when `capture trial` creates it."""
    return config_dir() / "allowed_signers"


def hub_cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub resolves it (without importing it):
    ``explicit`` (``--hf-cache``), else ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE`` (its older
    name), else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``. It may not exist."""
    if explicit is not None and str(explicit):
        return Path(explicit).expanduser()
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"
