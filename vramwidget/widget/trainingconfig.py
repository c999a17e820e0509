"""The training-config panel: a user's own training config (axolotl, torchtune, LLaMA-Factory,
LitGPT YAML; HF/TRL, DeepSpeed JSON; accelerate YAML) fills the controls.

The frontend sends the file's text in the ``training_config`` trait; :mod:`vramwidget.readers`
maps it (:func:`vramwidget.from_training_config`), and the keywords that are widget controls
are set at once (one update).  ``training_config_report`` says what was used, what was not,
and the keywords that have no control here (they still apply in
``vw.from_training_config(...).estimate()``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Union

from ..errors import VramError
from .state import ESTIMATE_INPUTS, INPUTS, PARALLEL_INPUTS

_MAX_TEXT = 1 << 20  # a training config is a few KB


def parse_config_text(text: str) -> Dict[str, Any]:
    """A pasted or uploaded config's text (YAML, of which JSON is a subset) as a mapping."""
    if len(text) > _MAX_TEXT:
        raise VramError(f"training_config: {len(text):,} characters is not a training config (a few KB)",
                        field="training_config")
    from ..readers._common import parse_yaml

    data = parse_yaml(text, "training_config", "training_config")
    if not isinstance(data, dict):
        raise VramError("training_config: expected a mapping of settings (a YAML or JSON object)",
                        field="training_config")
    return data


class TrainingConfigPanel:
    """Fill the controls from a training config."""

    def load_training_config(self, source: Union[str, Mapping[str, Any]]) -> Any:
        """Set the controls from a training config: a file path, its text, or its parsed dict.

        Every setup and multi-GPU control the file does not set goes back to its default (the
        file describes the whole setup); the GPU, the mode, and the model when the file names
        none, are kept.  Returns the :class:`~vramwidget.readers.TrainingConfig`; keywords
        without a control here are listed in ``training_config_report["not_controls"]``.
        """
        import os

        from ..readers import from_training_config

        if isinstance(source, str) and "\n" not in source and os.path.isfile(source):
            cfg = from_training_config(source)
        elif isinstance(source, str):
            cfg = from_training_config(parse_config_text(source))
        else:
            cfg = from_training_config(source)
        values: Dict[str, Any] = {**cfg.setup, **cfg.parallel}
        if cfg.model is not None and isinstance(cfg.model, str):
            values["model"] = cfg.model
        applied = {k: v for k, v in values.items() if k in INPUTS}
        if "lora_targets" in applied:
            # the widget's "every linear layer" is lora_targets=None (peft's all-linear)
            t = list(applied["lora_targets"])
            applied["lora_targets"] = None if t == ["all-linear"] else t
        not_controls: List[str] = sorted(set(values) - set(applied))
        with self.hold_sync():
            self._busy = True
            try:
                if "model" in applied:
                    self.config_json = ""
                # the file describes the whole setup: what it does not set is at its default
                # (the GPU, the mode and the model when the file names none are kept)
                for k in ESTIMATE_INPUTS + PARALLEL_INPUTS:
                    if k != "model" and k not in applied:
                        setattr(self, k, self.traits()[k].default())
                for k, v in applied.items():
                    setattr(self, k, v)
                # what the file sets is the user's; the practitioner defaults apply to the rest
                self._explicit = {k for k in self._explicit if k not in ESTIMATE_INPUTS + PARALLEL_INPUTS} \
                    | set(applied)
                self._defaulted = {}
                self._link(None)
            finally:
                self._busy = False
            self.training_config_report = {
                "format": cfg.format,
                "applied": {k: (list(v) if isinstance(v, tuple) else v) for k, v in applied.items()},
                "not_controls": not_controls,
                "ignored": [[f, why] for f, why in cfg.ignored],
                "notes": list(cfg.notes),
                "error": "",
            }
        self._update()
        return cfg

    def _on_training_config(self, change: Dict[str, Any]) -> None:
        text = change["new"] or ""
        if not text.strip():
            return
        try:
            self.load_training_config(text)
        except VramError as e:
            self.training_config_report = {"error": str(e).splitlines()[0]}
            self._set_error(str(e), e.field or "training_config")
