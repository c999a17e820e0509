"""Altair charts drawn offline with the Vega bundled in vramwidget (no CDN)."""

import altair as alt
import pytest

import vramwidget as vw
from vramwidget.show.chartview import ChartView, show


def test_chartview_holds_the_spec_and_the_bundle():
    est = vw.estimate("gpt2", batch_size=2, seq_len=256)
    view = show(vw.chart(est))
    assert isinstance(view, ChartView)
    assert view.spec == vw.chart(est).to_dict()
    assert view._view_kind == "chart"
    # the same bundled frontend as the Calculator (anywidget reads the file into _esm)
    assert "vramwidget frontend" in str(view._esm)[:200]


def test_show_takes_an_estimate_or_a_dict():
    est = vw.estimate("gpt2", batch_size=2, seq_len=256)
    assert show(est).spec == vw.chart(est).to_dict()
    assert show({"mark": "bar"}).spec == {"mark": "bar"}
    with pytest.raises(TypeError, match="Altair chart"):
        show(42)


def test_altair_renderer_gives_a_widget_mimebundle():
    """alt.renderers.enable("vramwidget") (entry point, also registered on import)."""
    old = alt.renderers.active
    try:
        alt.renderers.enable("vramwidget")
        bundle = vw.chart(vw.estimate("gpt2"))._repr_mimebundle_()
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert not any("cdn" in str(v) for v in bundle.values())
    finally:
        alt.renderers.enable(old)


def test_the_bundle_draws_a_chart_view():
    """The frontend's render() switches to a chart-only view for ChartView models."""
    from pathlib import Path

    src = (Path(vw.__file__).parent / "static" / "widget.js").read_text(encoding="utf-8")
    assert "chart-view" in src and "_view_kind" in src
