"""Every notebook in notebooks/ runs top to bottom without an error (issue 5).

Each notebook is executed with nbclient on the ``python3`` kernel, with a limit of 300 s
per cell, from a copy in a temporary folder, so the committed file is never rewritten.
The kernel imports this checkout, whether or not the package is installed. The committed
notebooks are also checked to be saved clean: no outputs, no execution counts and no
widget state, so they stay small and show no stale numbers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "validation.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_saved_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a cell has outputs: {cell.source[:60]!r}"
            assert cell.execution_count is None, f"{path.name}: {cell.source[:60]!r}"
    assert "widgets" not in nb.metadata, f"{path.name} carries widget state"
    assert path.stat().st_size < 60_000, f"{path.name} is {path.stat().st_size:,} bytes"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_error(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    # the kernel imports this checkout (installed or not) and writes nothing into it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    work = tmp_path / path.name
    shutil.copy(path, work)
    nb = nbformat.read(work, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on an error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count is not None for c in ran)
