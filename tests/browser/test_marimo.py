"""notebooks/marimo_app.py served by ``marimo run`` on 127.0.0.1, opened in headless
Chromium: the widget renders its treemaps through ``mo.ui.anywidget`` (issue 5).

The server runs with a random access token and skips marimo's update check. It gets the
same private config folders as the JupyterLab server and is stopped when the test ends.
The page records its requests. The widget itself must fetch nothing from outside
loopback (its JavaScript is bundled); the test fails on any such request.
"""

from __future__ import annotations

import re

import pytest

from .conftest import BrowserPage, chart_labels, chart_shapes

pytestmark = pytest.mark.browser


def test_marimo_app_renders_the_widget_treemaps(browser, marimo_server, artifacts):
    bp = BrowserPage(browser, viewport=(1400, 1500))
    try:
        page = bp.page
        page.goto(f"{marimo_server.base}/?access_token={marimo_server.token}", wait_until="domcontentloaded")
        widget = page.locator("[data-testid=vramwidget]")
        widget.wait_for(state="visible", timeout=120_000)
        for name in ("detail", "comparison", "phases"):
            page.locator(f"[data-testid=chart-{name}].vw-ready svg g.mark-rect path").first.wait_for(
                state="attached", timeout=60_000)
        widget.scroll_into_view_if_needed()
        detail = page.locator("[data-testid=chart-detail]")
        shapes = chart_shapes(detail)
        assert len(shapes) >= 8, shapes
        assert any(re.search(r"\d GiB", t) for t in chart_labels(detail))
        assert len(chart_shapes(page.locator("[data-testid=chart-comparison]"))) >= 20
        assert "peak allocated" in page.locator("[data-testid=summary]").inner_text()

        # the reactive cell below reads calc.value: a change in the widget reaches it
        readout = page.get_by_text("Current estimate:")
        readout.wait_for(timeout=60_000)
        before = readout.locator("xpath=..").inner_text()
        control = page.locator("[data-testid=control-batch_size]")
        control.fill("4")
        control.press("Tab")
        page.wait_for_function(
            "(old) => [...document.querySelectorAll('p, span, div')].some(e => e.innerText && "
            "e.innerText.startsWith('Current estimate:') && e.innerText !== old)",
            arg=before, timeout=60_000)
        page.screenshot(path=str(artifacts / "marimo-widget.png"), full_page=True)

        external = bp.recorder.external()
        assert external == [], external
        assert not [m for m in bp.console if "vramwidget" in m or "vega" in m.lower()], bp.console
    finally:
        bp.close()
