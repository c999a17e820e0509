"""Issue 11, "Must show": in the widget, typing a Hub id of a family with no module (with the
trace extra installed) shows tracing, then the estimate.  Real JupyterLab and Chromium.

Nothing can be fetched from the Hub here, so the notebook's first cell lays out a local
huggingface_hub cache holding only ``config.json`` of ``acme/tiny-phi`` (a small config of
model_type "phi", which has no module in vramwidget/model/families/) and points huggingface_hub
at it with ``HF_HUB_OFFLINE=1``: the widget reaches it through the real loading path
(``vramwidget.model.hub.fetch_config`` -> ``hf_hub_download``).

The test types the Hub id into the model box and presses Enter.  The status slot says
"tracing acme/tiny-phi…" and the last estimate (Llama 3.2 1B) stays on screen, dimmed;
then the traced estimate replaces it, with a note that it was traced.  Screenshots go to
test-artifacts/trace-tracing.png and trace-done.png.
"""

from __future__ import annotations

import json

import pytest

from .conftest import BrowserPage, Lab, write_notebook

pytestmark = pytest.mark.browser

trace = pytest.importorskip("vramwidget.trace")
if not trace.available():
    pytest.skip("the trace extra (torch, transformers, peft) is not installed", allow_module_level=True)

NOTEBOOK = "trace.ipynb"
REPO_ID = "acme/tiny-phi"
#: the same small phi config as tests/test_widget_trace.py
TINY_PHI = {
    "model_type": "phi", "architectures": ["PhiForCausalLM"], "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16",
}
CELLS = [
    "import json, os, pathlib, tempfile\n"
    "import huggingface_hub.constants as hub_constants\n"
    "# a huggingface_hub cache holding only config.json of the repository (its own layout)\n"
    "hub = pathlib.Path(tempfile.mkdtemp()) / 'hub'\n"
    f"repo = hub / 'models--{REPO_ID.replace('/', '--')}'\n"
    "commit = '0123456789abcdef0123456789abcdef01234567'\n"
    "(repo / 'refs').mkdir(parents=True)\n"
    "(repo / 'refs' / 'main').write_text(commit)\n"
    "(repo / 'snapshots' / commit).mkdir(parents=True)\n"
    f"(repo / 'snapshots' / commit / 'config.json').write_text(json.dumps({json.dumps(TINY_PHI)}))\n"
    "hub_constants.HF_HUB_CACHE = str(hub)\n"
    "os.environ['HF_HUB_OFFLINE'] = '1'",
    "import vramwidget\ncalc = vramwidget.Calculator('llama-3.2-1b', seq_len=256)\ncalc",
]


def test_typing_a_hub_id_without_a_family_shows_tracing_then_the_estimate(browser, jupyter_lab, artifacts):
    write_notebook(jupyter_lab.root / NOTEBOOK, CELLS)
    bp = BrowserPage(browser, viewport=(1400, 1000))
    page = bp.page
    try:
        lab = Lab(page, jupyter_lab)
        lab.open(NOTEBOOK)
        lab.hide_side_panels()
        lab.run_all()
        assert lab.errors() == []
        widget = lab.panel.locator("[data-testid=vramwidget]")
        widget.wait_for(state="visible", timeout=120_000)
        page.locator("[data-testid=chart-detail].vw-ready svg g.mark-rect path").first.wait_for(
            state="attached", timeout=60_000)
        summary = page.locator("[data-testid=summary]")
        assert "llama-3.2-1b" in summary.inner_text()

        box = page.locator("[data-testid=control-model]")
        box.fill(REPO_ID)
        box.press("Enter")
        # tracing: said in the status slot, the last estimate still shown, dimmed
        page.wait_for_function(
            "() => { const s = document.querySelector('[data-testid=status]');"
            " return s && s.dataset.status === 'tracing'; }", timeout=60_000)
        status = page.locator("[data-testid=status]").inner_text()
        assert status.startswith(f"tracing {REPO_ID}…"), status
        assert "vw-busy" in (widget.get_attribute("class") or "")
        assert "llama-3.2-1b" in summary.inner_text()
        assert page.locator("[data-testid=error]").get_attribute("data-shown") == "false"
        lab.scroll_to_top(widget)
        page.screenshot(path=str(artifacts / "trace-tracing.png"))

        # then the traced estimate, with its note; the slot empties, the dimming goes
        page.wait_for_function(
            "(id) => { const s = document.querySelector('[data-testid=status]');"
            " const m = document.querySelector('[data-testid=summary]');"
            " return s && s.dataset.status === 'idle' && m && m.innerText.includes(id); }",
            arg=REPO_ID, timeout=300_000)
        text = summary.inner_text()
        assert "traced: model_type 'phi' has no analytic family module" in text, text
        assert "vw-busy" not in (widget.get_attribute("class") or "")
        assert page.locator("[data-testid=error]").get_attribute("data-shown") == "false"
        need = float(page.locator("[data-testid=headline]").get_attribute("data-need-bytes"))
        py = lab.run_new_cell("print(calc.estimate.backend, calc.estimate.model_name, calc.estimate.device_total_bytes)"
                              ).split()
        assert py[0] == "trace" and py[1] == REPO_ID and float(py[2]) == need
        lab.scroll_to_top(widget)
        page.screenshot(path=str(artifacts / "trace-done.png"))
    finally:
        bp.close()
