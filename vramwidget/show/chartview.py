"""Show any Altair chart offline, with the Vega that ships inside vramwidget.

Altair's default notebook output loads Vega from a CDN.  ``ChartView`` renders a chart
with the bundle in ``vramwidget/static/widget.js`` instead, so charts work with no network
(JupyterLab, Notebook 7, VS Code, Colab, marimo).  Two ways to use it::

    import vramwidget as vw
    vw.show(vw.chart(est))               # one chart
    import altair as alt
    alt.renderers.enable("vramwidget")   # every Altair chart in this notebook
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict

import anywidget
import traitlets

_STATIC = pathlib.Path(__file__).resolve().parent.parent / "static"


class ChartView(anywidget.AnyWidget):
    """One Vega-Lite chart drawn with the bundled Vega (no CDN)."""

    _esm = _STATIC / "widget.js"
    _css = _STATIC / "widget.css"
    _view_kind = traitlets.Unicode("chart").tag(sync=True)
    spec = traitlets.Dict(help="the Vega-Lite spec (as Altair's chart.to_dict() gives it)").tag(sync=True)

    def __init__(self, chart: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if chart is not None:
            self.spec = _to_spec(chart)


def _to_spec(chart: Any) -> Dict[str, Any]:
    from ..result import Estimate

    if isinstance(chart, dict):
        return chart
    if isinstance(chart, Estimate):
        from .charts import detail_chart

        return detail_chart(chart).to_dict()
    if hasattr(chart, "to_dict"):
        return chart.to_dict()
    raise TypeError(f"show() takes an Altair chart, a Vega-Lite dict or an Estimate, not {type(chart).__name__}")


def show(chart: Any) -> ChartView:
    """Display ``chart`` (an Altair chart, a spec dict or an Estimate) with the bundled Vega."""
    view = ChartView(chart)
    try:
        from IPython.display import display

        display(view)
    except ImportError:  # not in IPython: the caller can display the returned widget
        pass
    return view


def _renderer(spec: Dict[str, Any], **metadata: Any) -> Dict[str, Any]:
    """An Altair renderer: the chart as a ChartView widget's mimebundle."""
    bundle = ChartView(spec)._repr_mimebundle_()
    if isinstance(bundle, tuple):  # (data, metadata) in some ipywidgets versions
        bundle = bundle[0]
    return bundle


def register_altair_renderer() -> None:
    """Make ``alt.renderers.enable("vramwidget")`` available (done on import)."""
    import altair as alt

    if "vramwidget" not in alt.renderers.names():
        alt.renderers.register("vramwidget", _renderer)


register_altair_renderer()
