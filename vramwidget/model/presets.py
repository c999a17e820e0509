"""Built-in presets: real config.json contents shipped as data files in ``presets/``.

Each file holds ``{"name", "hub_id", "aliases", "family", "params_label", "config"}``.
A preset is found by its short name (``llama-2-7b``), its Hub id
(``meta-llama/Llama-2-7b-hf``) or an alias, case-insensitively, without any network.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from ..errors import UnknownPresetError
from ..inputs import close_match, shown

PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "presets")

_PRESETS: Optional[Dict[str, Dict[str, Any]]] = None
_INDEX: Dict[str, str] = {}


def _load() -> Dict[str, Dict[str, Any]]:
    global _PRESETS
    if _PRESETS is None:
        presets: Dict[str, Dict[str, Any]] = {}
        for fn in sorted(os.listdir(PRESET_DIR)):
            if not fn.endswith(".json"):
                continue
            with open(os.path.join(PRESET_DIR, fn), encoding="utf-8") as f:
                data = json.load(f)
            name = data["name"]
            presets[name] = data
            for key in [name, data.get("hub_id")] + list(data.get("aliases") or []):
                if key:
                    _INDEX[key.lower()] = name
        _PRESETS = presets
    return _PRESETS


def list_presets() -> List[str]:
    """Names of every built-in preset, sorted."""
    return sorted(_load())


def get(name: str) -> Dict[str, Any]:
    """The preset record for a name, Hub id or alias; UnknownPresetError with close matches otherwise."""
    hit = find(name)
    if hit is None:
        raise unknown_preset_error(name)
    return hit


def find(name: str) -> Optional[Dict[str, Any]]:
    """The preset record for a name, Hub id or alias (case-insensitive), or None."""
    presets = _load()
    key = _INDEX.get(name.strip().lower())
    return presets[key] if key else None


def unknown_preset_error(name: str) -> UnknownPresetError:
    """The error for an unknown preset name, naming close matches."""
    names = list(_load())
    keys = list(_INDEX)
    close = close_match(name.lower(), keys, n=4, cutoff=0.5)   # only for short names
    close_names = []
    for k in close:
        n = _INDEX[k]
        if n not in close_names:
            close_names.append(n)
    hint = f"; did you mean {', '.join(close_names)}?" if close_names else f"; presets: {', '.join(sorted(names)[:24])}, ..."
    return UnknownPresetError(
        f"model: unknown preset {shown(name)}{hint} (or give a config.json path, a Hub id like 'org/name', "
        f"or a parameter count like '7B')", field="model")
