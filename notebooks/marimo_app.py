"""vramwidget in marimo: the Calculator widget, and a reactive readout of its estimate.

    marimo edit notebooks/marimo_app.py        # edit
    marimo run notebooks/marimo_app.py         # as an app

marimo shows anywidgets (through ``mo.ui.anywidget``) but not ipywidgets boxes. That is
why every control of the widget lives in its own frontend. When a control changes, marimo
re-runs the cells that read ``calc.value``.
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App(width="full", app_title="vramwidget")


@app.cell
def _():
    import marimo as mo

    import vramwidget as vw

    return mo, vw


@app.cell
def _(mo):
    mo.md("""
    # How much GPU memory will this training run need?

    Pick a model and a training setup. The treemaps show where the memory goes at the
    peak, and how FP32, BF16 and 4-bit QLoRA compare on one scale.
    """)
    return


@app.cell
def _(mo, vw):
    calc = mo.ui.anywidget(vw.Calculator("llama-3.2-1b", gpu="RTX 4090"))
    calc
    return (calc,)


@app.cell
def _(calc, mo):
    # re-runs whenever a control of the widget changes (calc.value holds its traits)
    _summary = calc.value.get("summary") or {}
    _error = calc.value.get("error") or ""
    _text = _summary.get("text", "")
    mo.md(
        f"**Current estimate:** {_text}"
        + (f"\n\n*Input not accepted:* {_error}" if _error else "")
    )
    return


if __name__ == "__main__":
    app.run()
