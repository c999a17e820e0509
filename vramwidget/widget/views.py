"""What the charts and the component table are made of: chart sizes, the Vega-Lite specs of
each mode, the table rows and the comparison's verdict captions."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .. import charts, gpus
from ..result import Estimate
from ..treemap import KNOWN_COMPONENTS, fmt_gib, total_bytes
from ..units import GIB

#: chart sizes in pixels (the treemap layout is computed for exactly these)
DETAIL_SIZE = (640.0, 340.0)
COMPARISON_SIZE = (640.0, 206.0)
PHASE_SIZE = (640.0, 170.0)
#: height of the comparison's caption band: name and total, plus a verdict line with a GPU
COMPARISON_HEADER = 34.0
COMPARISON_HEADER_VERDICT = 48.0
#: ... plus a line with the scenario's step time on that GPU
COMPARISON_HEADER_TIME = 61.0

#: the component kinds each mode's detail legend lists (every colour stays fixed)
_LEGEND_TRAINING: Tuple[str, ...] = tuple(
    k for k in KNOWN_COMPONENTS if k not in ("kv cache", "logits"))
_LEGEND_INFERENCE: Tuple[str, ...] = (
    "weights", "quantization constants", "kv cache", "activations", "logits", "workspace",
    "allocator reserve", "cuda context")



def build_specs(mode: str = "training") -> Dict[str, Any]:
    """The chart specs of a mode (the frontend embeds each once, then swaps rows)."""
    legend = _LEGEND_INFERENCE if mode == "inference" else _LEGEND_TRAINING
    return {
        charts.DETAIL: charts.detail_spec_chart(width=DETAIL_SIZE[0], height=DETAIL_SIZE[1],
                                                legend_values=legend).to_dict(),
        charts.COMPARISON: charts.comparison_chart(width=COMPARISON_SIZE[0],
                                                   height=COMPARISON_SIZE[1]).to_dict(),
        charts.PHASES_DATA: charts.phase_chart(width=PHASE_SIZE[0], height=PHASE_SIZE[1]).to_dict(),
    }


def table_rows(est: Estimate) -> List[Dict[str, Any]]:
    """The component table: one row per component, in the treemap's order."""
    total = total_bytes(est) or 1.0
    order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
    comps = sorted(est.components, key=lambda c: order.get(c.name, 99))
    return [{
        "component": c.name,
        "color": charts.component_color(c.name),
        "bytes": c.bytes,
        "gib": c.bytes / GIB,
        "share": c.bytes / total,
        "groups": [{"name": g.name, "gib": g.bytes / GIB} for g in
                   sorted(c.children, key=lambda g: -g.bytes)],
        "formula": c.formula,
    } for c in comps]


def add_verdicts(rows: List[Dict[str, Any]], gpu: gpus.GPU, own_fits: Dict[str, Optional[bool]],
                 seconds: Optional[Dict[str, float]] = None) -> None:
    """Give each scenario caption of the comparison a verdict line against ``gpu``:
    "✓ fits" or "✗ 3.2 GiB over" (device total vs the card's usable memory; a serving
    budget's own verdict where the estimate has one), and ``fits``/``over_gib`` fields;
    with ``seconds`` (scenario -> step time on ``gpu``) a line "0.42 s per step" and a
    ``step_seconds`` field."""
    usable = gpu.usable_bytes
    for r in rows:
        if r["level"] != "title":
            continue
        total = r["bytes"]
        own = own_fits.get(r["scenario"])
        fits = own if own is not None else total <= usable
        over = max(total - usable, 0.0) / GIB
        if fits:
            verdict = "✓ fits"
        elif own is not None:
            verdict = "✗ no KV room"
        else:
            verdict = f"✗ {over:.1f} GiB over" if over >= 0.05 else f"✗ {over * 1024:.0f} MiB over"
        r["fits"] = bool(fits)
        r["over_gib"] = 0.0 if fits else over
        r["text"] = f"{r['label']}\n{fmt_gib(total)}\n{verdict}"
        secs = (seconds or {}).get(r["scenario"])
        if secs is not None:
            r["step_seconds"] = secs
            r["text"] += f"\n{secs:.3g} s per step"

