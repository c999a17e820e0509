"""Fetch only a model's config.json from the Hugging Face Hub (optional, needs network)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from ..errors import VramError
from ..inputs import shown


def fetch_config(repo_id: str) -> Dict[str, Any]:
    """Download ``config.json`` of ``repo_id`` with huggingface_hub (HF_TOKEN honoured).

    Offline, gated or missing repositories give a VramError naming the alternatives:
    a built-in preset, a local config.json path, or a pasted config dict.
    """
    alternatives = ("use a built-in preset (vramwidget.list_presets()), a local config.json path, "
                    "or pass the config as a dict")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise VramError(f"model: {shown(repo_id)} is not a preset and fetching it from the Hub needs the "
                        f"huggingface_hub package (pip install 'vramwidget[hub]'); or {alternatives}",
                        field="model") from None
    token = os.environ.get("HF_TOKEN") or None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline and not _hub_reachable():
        # Without a network huggingface_hub retries for ~20 s; look in the local cache only.
        offline = True
    try:
        with _quiet_hub_logs():
            path = hf_hub_download(repo_id, "config.json", token=token, local_files_only=offline)
    except Exception as e:  # network errors, gated repos, missing files: one clear line
        kind = type(e).__name__
        reason = {"GatedRepoError": "the repository is gated (accept its licence and set HF_TOKEN)",
                  "RepositoryNotFoundError": "no such repository (or it is private: set HF_TOKEN)",
                  "EntryNotFoundError": "the repository has no config.json",
                  "LocalEntryNotFoundError": "offline and not in the local cache",
                  # huggingface_hub/utils/_validators.py validate_repo_id: its message repeats the whole id
                  "HFValidationError": "not a Hub id (name or org/name: letters, digits, '-', '_', '.', "
                                       "at most 96 characters)"}.get(kind)
        if reason is None:   # another error: its first line, with the id (maybe huge) shown shortened
            reason = f"{kind}: {str(e).replace(repo_id, shown(repo_id)) if repo_id else e}".splitlines()[0][:200]
        raise VramError(f"model: could not fetch config.json of {shown(repo_id)}: {reason}; {alternatives}",
                        field="model") from None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """A TCP connection to the Hub endpoint within ``timeout_s`` (no request is sent)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - an unusual huggingface_hub: let it try
        return True
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return True
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class _quiet_hub_logs:
    """Silence huggingface_hub's retry warnings while fetching (the error is reported once)."""

    def __enter__(self):
        import logging

        self._logger = logging.getLogger("huggingface_hub")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)
        return False
