"""The "import training config" box in a real JupyterLab (issue #12, item 5): pasting an
axolotl YAML and pressing apply fills the controls and reports what was used."""

from __future__ import annotations

import pytest

from .conftest import BrowserPage, Lab, write_notebook

pytestmark = pytest.mark.browser

NOTEBOOK = "training_config.ipynb"
AXOLOTL = """base_model: llama-3.2-1b
adapter: lora
lora_r: 32
lora_alpha: 64
lora_target_linear: true
micro_batch_size: 6
sequence_len: 1024
gradient_checkpointing: true
optimizer: adamw_torch_fused
learning_rate: 0.0002
"""


def test_pasted_axolotl_config_fills_the_controls(browser, jupyter_lab, artifacts):
    write_notebook(jupyter_lab.root / NOTEBOOK,
                   ["import vramwidget\ncalc = vramwidget.Calculator(\"llama-3.2-1b\")\ncalc"])
    bp = BrowserPage(browser, viewport=(1400, 1000))
    page = bp.page
    try:
        lab = Lab(page, jupyter_lab)
        lab.open(NOTEBOOK)
        lab.run_all()
        widget = lab.panel.locator("[data-testid=vramwidget]")
        widget.wait_for(state="visible", timeout=120_000)
        page.locator("[data-testid=group-import-toggle]").click()     # the Import config group
        page.locator("[data-testid=training-config] > summary").click()
        box = page.locator("[data-testid=control-training_config]")
        box.wait_for(state="visible")
        box.fill(AXOLOTL)
        page.locator("[data-testid=training-config-apply]").click()
        page.wait_for_function(
            "() => { const e = document.querySelector('[data-testid=control-batch_size]'); return e && e.value === '6'; }",
            timeout=60_000)
        assert page.locator("[data-testid=control-method]").input_value() == "lora"
        assert page.locator("[data-testid=control-seq_len]").input_value() == "1024"
        assert page.locator("[data-testid=control-optimizer]").input_value() == "adamw_fused"
        assert page.locator("[data-testid=control-lora_targets-all]").is_checked()  # lora_target_linear
        report = page.locator("[data-testid=training-config-report]").inner_text()
        assert "axolotl" in report
        out = lab.run_new_cell("print(calc.batch_size, calc.lora_r, calc.method, repr(calc.error))")
        assert out.split()[:3] == ["6", "32", "lora"]
        assert page.locator("[data-testid=error]").is_hidden()
        box.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "jupyterlab-training-config.png"), full_page=False)
        assert bp.recorder.external() == []
    finally:
        bp.close()
