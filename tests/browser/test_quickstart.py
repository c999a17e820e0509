"""notebooks/quickstart.ipynb in a real JupyterLab: run it all, find the rendered treemaps
(issue 5, "Must show").

A copy of the notebook goes into the server's temporary root, so the committed file is
never rewritten. The test runs every cell through JupyterLab's "run all cells" command
and checks four things: no cell raised; the widget drew its treemaps (rectangles with
"GiB" labels); the Altair charts of the five questions rendered; and no request left
loopback. The notebook enables vramwidget's Altair renderer, which draws every chart with
the Vega bundled in the package (Altair's default would ask a CDN for Vega, and the test
fails on that request).
"""

from __future__ import annotations

import re
import shutil

import pytest

from .conftest import ROOT, BrowserPage, Lab, chart_labels, chart_shapes

pytestmark = pytest.mark.browser

QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
#: comparison (Q1), 13B treemap (Q2), checkpointing bars (Q3), 4-bit bars (Q4), layers (Q5)
MIN_ALTAIR_CHARTS = 5


def test_quickstart_runs_in_jupyterlab_and_draws_treemaps(browser, jupyter_lab, artifacts):
    shutil.copy(QUICKSTART, jupyter_lab.root / QUICKSTART.name)
    bp = BrowserPage(browser, viewport=(1400, 1400))
    try:
        page = bp.page
        lab = Lab(page, jupyter_lab)
        lab.open(QUICKSTART.name)
        lab.run_all(timeout=300)
        assert lab.errors() == []

        # the widget: its treemaps are drawn
        widget = lab.panel.locator("[data-testid=vramwidget]")
        assert widget.count() >= 1
        detail = widget.first.locator("[data-testid=chart-detail]")
        page.locator("[data-testid=chart-detail].vw-ready svg g.mark-rect path").first.wait_for(
            state="attached", timeout=60_000)
        page.locator("[data-testid=chart-comparison].vw-ready svg g.mark-rect path").first.wait_for(
            state="attached", timeout=60_000)
        lab.scroll_to_top(widget.first)  # off-screen cells are not laid out (content-visibility)
        page.wait_for_timeout(200)
        assert len(chart_shapes(detail)) >= 8
        assert any(re.search(r"\d GiB", t) for t in chart_labels(detail))
        # the cell after the widget set gradient_checkpointing = "full": the widget shows it
        page.wait_for_function(
            "() => document.querySelector('[data-testid=control-gradient_checkpointing]').value === 'full'")
        assert widget.first.locator("[data-testid=error]").is_hidden()

        # the Altair charts of the five questions, drawn by the offline "vramwidget" renderer
        svg_outputs = page.locator(".jp-OutputArea-output [data-testid=chart-view].vw-ready svg.marks")
        svg_outputs.nth(MIN_ALTAIR_CHARTS - 1).wait_for(state="attached", timeout=60_000)
        sizes = svg_outputs.evaluate_all("els => els.map(e => [e.naturalWidth || e.clientWidth, "
                                         "e.naturalHeight || e.clientHeight])")
        assert len(sizes) >= MIN_ALTAIR_CHARTS
        assert all(w > 100 and h > 100 for w, h in sizes), sizes

        lab.hide_side_panels()
        lab.scroll_to_top(widget.first)
        page.wait_for_timeout(300)
        page.screenshot(path=str(artifacts / "jupyterlab-quickstart.png"))
        assert bp.recorder.external() == [], bp.recorder.external()
    finally:
        bp.close()
