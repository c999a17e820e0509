"""The drop-downs' choices: [value, short label, long label] for every select (the short
label is shown, the long one is its tooltip), the presets, the GPUs and LoRA targets."""

from __future__ import annotations

from typing import Any, Dict, List

from .. import gpus
from .inference import inference_options
from .multigpu import strategy_options
from .training import setup_choices
from .views import short_label


class OptionsPanel:
    """The ``options`` trait, rebuilt only when the model changes."""

    def _options(self, arch: Any) -> Dict[str, Any]:
        if getattr(self, "_options_key", None) == self._arch_key and self.options:
            return self.options
        self._options_key = self._arch_key
        opts: Dict[str, Any] = {k: [list(x) for x in v] for k, v in setup_choices().items()}

        opts["mode"] = [["training", "Training (one step)"], ["inference", "Inference (generate / serve)"]]
        opts["strategy"] = strategy_options()
        opts.update(inference_options())
        # [value, short label, long label]: the short one is shown, the long one is its tooltip
        for name, choices in list(opts.items()):
            if name in ("presets", "lora_targets"):
                continue
            opts[name] = [[c[0], short_label(name, c[0], c[1]), c[1]] for c in choices]
        opts["presets"] = _preset_options()
        opts["gpus"] = [[g.name, g.name, g.label] for g in gpus.list_gpus()]
        try:
            opts["lora_targets"] = [[m, m] for m in arch.linear_modules()]
        except Exception:
            opts["lora_targets"] = []
        return opts


def _preset_options() -> List[List[str]]:
    try:
        from ..model import presets
    except ImportError:
        return []
    out = []
    for name in presets.list_presets():
        p = presets.find(name) or {}
        label = " · ".join(x for x in (p.get("family"), p.get("params_label")) if x)
        out.append([name, label])
    return out


def nearest_presets(model: str, n: int = 3) -> List[str]:
    """The presets whose name or Hub id (or an alias) is closest to a model the user typed
    (a Hub id that could not be fetched: a typo, or offline), closest first."""
    import difflib

    from ..model import presets

    typed = model.strip().lower()
    if not typed:
        return []
    names: Dict[str, str] = {}
    for name in presets.list_presets():
        p = presets.find(name) or {}
        for key in [name, p.get("hub_id") or "", *(p.get("aliases") or [])]:
            if key:
                names.setdefault(key.lower(), name)
    close = difflib.get_close_matches(typed, list(names), n=10, cutoff=0.6)
    return list(dict.fromkeys(names[c] for c in close))[:n]
