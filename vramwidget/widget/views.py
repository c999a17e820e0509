"""What the charts and the component table are made of: chart sizes, the Vega-Lite specs of
each mode, the table rows and the comparison's verdict captions."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..show import charts
from .. import gpus
from ..result import Estimate
from ..parallel.strategies import BY_NAME
from ..show.treemap import KNOWN_COMPONENTS, UnitBox, caption_rows, comparison_rows, fmt_gib, total_bytes
from ..units import GIB
from ..fit.verdict import capacity_bytes

#: chart sizes in pixels (the treemap layout is computed for exactly these)
DETAIL_SIZE = (640.0, 320.0)
COMPARISON_SIZE = (640.0, 206.0)
PHASE_SIZE = (640.0, 215.0)
FITMAP_SIZE = (330.0, 235.0)
#: the height of one row of the comparison (a narrow column lays the scenarios out in rows)
COMPARISON_ROW_HEIGHT = 170.0


def comparison_header(captions: Dict[str, Dict[str, Any]]) -> float:
    """The caption band's height: as many lines as the longest caption."""
    lines = max((c["text"].count("\n") + 1 for c in captions.values()), default=2)
    return 8.0 + 13.0 * lines



def build_specs(mode: str = "training", validate: bool = False) -> Dict[str, Any]:
    """The chart specs of a mode (the frontend embeds each once, then swaps rows): the same
    for every setup, made once per process (a copy each call).  Altair's check of each spec
    against the Vega-Lite schema (``validate``: ~0.3-0.75 s, most of a widget's first
    build) is made by tests/test_widget.py, not in the user's kernel."""
    import copy

    key = (mode, validate)
    hit = _SPECS.get(key)
    if hit is None:
        # the detail's legend is drawn by the frontend from the table: only the parts present
        hit = _SPECS[key] = {
            charts.DETAIL: charts.detail_spec_chart(width=DETAIL_SIZE[0], height=DETAIL_SIZE[1],
                                                    legend=False).to_dict(validate=validate),
            charts.FITMAP: charts.fitmap_chart(width=FITMAP_SIZE[0],
                                               height=FITMAP_SIZE[1]).to_dict(validate=validate),
            charts.COMPARISON: charts.comparison_chart(width=COMPARISON_SIZE[0],
                                                       height=COMPARISON_SIZE[1]).to_dict(validate=validate),
            charts.PHASES_DATA: charts.phase_chart(width=PHASE_SIZE[0],
                                                   height=PHASE_SIZE[1]).to_dict(validate=validate),
        }
    return copy.deepcopy(hit)


#: (mode, validate) -> the specs build_specs made
_SPECS: Dict[Tuple[str, bool], Dict[str, Any]] = {}


def table_rows(est: Estimate) -> List[Dict[str, Any]]:
    """The component table: one row per component, in the treemap's order."""
    total = total_bytes(est) or 1.0
    order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
    comps = sorted(est.components, key=lambda c: order.get(c.name, 99))
    return [{
        "component": c.name,
        "color": charts.component_color(c.name),
        "text_color": charts.text_color(charts.component_color(c.name)),
        "bytes": c.bytes,
        "gib": c.bytes / GIB,
        "share": c.bytes / total,
        "groups": [{"name": g.name, "gib": g.bytes / GIB} for g in
                   sorted(c.children, key=lambda g: -g.bytes)],
        "formula": c.formula,
    } for c in comps]


def gpu_line(gpu: Optional[gpus.GPU]) -> Tuple[Optional[float], str]:
    """The GPU line of the charts: the capacity the verdict judges (what CUDA reports as the
    card's total, :func:`vramwidget.fit.verdict.capacity_bytes`) and its label; (None, "")
    without a GPU."""
    if gpu is None:
        return None, ""
    cap = capacity_bytes(gpu)
    return cap, f"{gpu.name} ({cap / GIB:.1f} GiB CUDA total)"


def comparison_captions(boxes: List[Tuple[str, Any]], gpu: Optional[gpus.GPU],
                        own_fits: Optional[Dict[str, Optional[bool]]] = None,
                        notes: Optional[Dict[str, str]] = None,
                        seconds: Optional[Dict[str, float]] = None) -> Dict[str, Dict[str, Any]]:
    """The caption of each scenario of the comparison (name -> ``{"text", ...}``), made before
    the layout so that each slot is as wide as its caption (``treemap.comparison_rows``).

    The text is the name and the total; with a GPU a verdict line against it: "✓ fits",
    "≈ tight" or "✗ 3.2 GiB over" (the verdict's three states, :func:`vramwidget.fit.verdict.state_of`:
    the device total on the card vs what CUDA reports as its total, with the estimate's band;
    a serving budget's own verdict where the estimate has one), with ``state`` / ``fits`` /
    ``over_gib`` fields.  ``notes`` replace the total for a scenario (a serving budget: its KV
    tokens and concurrent sequences, which is what differs between weight formats there);
    with ``seconds`` (scenario -> step time on ``gpu``) a line "0.42 s/step" and a
    ``step_seconds`` field, for a scenario that fits only (no time for a run that cannot
    start)."""
    from ..fit.verdict import band_bytes, state_of

    own_fits, notes, seconds = own_fits or {}, notes or {}, seconds or {}
    out: Dict[str, Dict[str, Any]] = {}
    for name, box in boxes:
        total = box.total_bytes
        note = notes.get(name, "")
        if gpu is None:
            out[name] = {"text": f"{name}\n{note}" if note else f"{name}\n{fmt_gib(total)}"}
            continue
        usable = capacity_bytes(gpu)
        own = own_fits.get(name)
        state = state_of(total, usable, band_bytes(box.reserved_bytes), bool(box.squeezed))
        if own is False:
            state = "does_not_fit"
        fits = own if own is not None else total <= usable
        over = max(total - usable, 0.0)
        verdict = ("✗ no KV room" if own is False else "≈ tight" if state == "tight"
                   else "✓ fits" if state == "fits" else f"✗ {fmt_gib(over)} over")
        c: Dict[str, Any] = {"state": state, "fits": bool(fits), "over_gib": 0.0 if fits else over / GIB,
                             "text": f"{name}\n{note}" if note else f"{name}\n{fmt_gib(total)}\n{verdict}"}
        secs = seconds.get(name)
        if secs is not None and state != "does_not_fit":
            c["step_seconds"] = secs
            c["text"] += f"\n{secs:.3g} s/step"
        out[name] = c
    return out


class ChartsPanel:
    """The Calculator's charts at the width the frontend has for them (``chart_width``)."""

    def _width(self) -> float:
        """The main chart column's width in pixels, as the frontend reported it (240 at least)."""
        return float(max(int(self.chart_width or DETAIL_SIZE[0]), 240))

    def _comparison(self, scenarios: List[Tuple[str, UnitBox]], gpu: Optional[gpus.GPU],
                    own_fits: Dict[str, Optional[bool]], times: Dict[str, float]) -> List[Dict[str, Any]]:
        """The comparison's rows at the column's width: each scenario's slot as wide as its
        caption, in as many rows as the captions need (``treemap.caption_rows``)."""
        width = self._width()
        captions = comparison_captions(scenarios, gpu, own_fits, dict(self._notes_now), times)
        k = caption_rows([c["text"] for c in captions.values()], width)
        height = COMPARISON_SIZE[1] if k == 1 else k * COMPARISON_ROW_HEIGHT
        cap, cap_label = gpu_line(gpu)
        rows = comparison_rows(scenarios, width, height, capacity_bytes=cap, capacity_label=cap_label,
                               header=comparison_header(captions), captions={n: c["text"] for n, c in captions.items()},
                               rows_of=k)
        for r in rows:
            if r["level"] == "title":
                r.update({k2: v for k2, v in captions[r["scenario"]].items() if k2 != "text"})
        self._comparison_size = [width, height]
        return rows


#: short option labels (the long ones become tooltips), so no drop-down is cut off
SHORT_LABELS: Dict[str, Dict[str, str]] = {
    "method": {"full": "Full", "lora": "LoRA", "qlora": "QLoRA", "freeze": "Last layers", "norms": "Norms only"},
    "precision": {"bf16": "Pure BF16", "amp_bf16": "BF16 mixed", "fp32": "FP32", "bf16_fp32_states": "BF16 + FP32 opt",
                  "fp16": "Pure FP16", "amp_fp16": "FP16 mixed", "fp8": "FP8 matmuls"},
    "optimizer": {"adamw": "AdamW", "adamw_fused": "AdamW fused", "adamw_8bit": "AdamW 8-bit",
                  "paged_adamw": "Paged AdamW", "paged_adamw_8bit": "Paged 8-bit", "adafactor": "Adafactor",
                  "sgd": "SGD", "sgd_momentum": "SGD momentum", "lion": "Lion", "galore_adamw": "GaLore AdamW",
                  "galore_adamw_8bit": "GaLore 8-bit"},
    "gradient_checkpointing": {"none": "None", "selective": "Selective", "full": "Full"},
    "attn_implementation": {"sdpa": "SDPA", "flash_attention_2": "FlashAttention 2", "eager": "Eager"},
    "quantization": {"none": "None", "nf4": "NF4 4-bit", "fp4": "FP4 4-bit", "int8": "LLM.int8"},
    "strategy": {name: s.short for name, s in BY_NAME.items()},   # data/strategies.json
    "kv_cache_dtype": {"auto": "auto"},
    "stack": {"hf": "HF / TRL / PEFT", "torchtune": "torchtune", "litgpt": "LitGPT", "unsloth": "Unsloth",
              "axolotl": "axolotl"},
    "loss": {"standard": "Full logits", "chunked": "Chunked", "liger": "Liger fused"},
    "lora_variant": {"lora": "LoRA", "dora": "DoRA"},
    "mode": {"training": "Training", "inference": "Inference"},
}


def short_label(field: str, value: str, label: str) -> str:
    """The option text a drop-down shows: a short name (the long label is the tooltip)."""
    hit = SHORT_LABELS.get(field, {}).get(value)
    if hit:
        return hit
    if field in ("weights", "kv_cache_dtype"):
        return value
    return label.split(" (")[0].split(":")[0].strip() or value
