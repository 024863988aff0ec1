"""The real `config.json` of the hub models the shipped recipes name, as package data.

`resispec/models/hub_configs/<org>/<name>/config.json` is the file the hub serves for `<org>/<name>` (copied verbatim,
no weights). It lets the memory plan and the stand-in (`standin=true`) work from the real shapes without a download.
"""

from __future__ import annotations

from pathlib import Path

HUB_CONFIGS = Path(__file__).resolve().parent


def shipped_config_dir(hub_name: str) -> Path | None:
    """The folder holding the shipped config.json of hub model `hub_name` (`org/name`), or None if none ships."""
    parts = hub_name.strip().split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    folder = HUB_CONFIGS / parts[0] / parts[1]
    return folder if (folder / "config.json").is_file() else None


def shipped_hub_names() -> list[str]:
    """Every hub name with a shipped config.json, sorted."""
    return sorted(f"{p.parent.parent.name}/{p.parent.name}" for p in HUB_CONFIGS.glob("*/*/config.json"))
