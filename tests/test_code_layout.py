"""The shape of the code: no import circles, a pure core, the widget split by job.

Imports are read from the source (every ``import`` statement, also those inside functions,
which a run-time check would miss), so a lazy import that closes a circle fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vramwidget"


def _modules() -> Dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str) -> Set[str]:
    """The vramwidget modules ``name`` imports anywhere in its source.  ``from . import x``
    counts as importing the submodule x, not the package (Python imports parents first)."""
    path = MODULES[name]
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            deps.update(subs)
            if target in MODULES and len(subs) < len(node.names):
                deps.add(target)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in MODULES)
    deps.discard(name)
    return deps


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles() -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports():
    """The reader finds imports inside functions (cli imports fit only in its commands)."""
    assert "vramwidget.fit" in GRAPH["vramwidget.cli"]
    assert "vramwidget.charts" in GRAPH["vramwidget.chartview"]


#: circles known and not yet broken, each with who breaks it; any other circle fails
KNOWN_CIRCLES = [
    # inference validates engine versions with engines' parsers; engines prices weights with
    # inference's storage: the serving work (issue 16) moves the shared part out
    ["vramwidget.engines", "vramwidget.inference"],
    # a vision-language family builds its vision tower's Architecture (families/vlm.py imports
    # architecture lazily; architecture imports the family registry): the VLM work breaks it
    ["vramwidget.architecture", "vramwidget.families", "vramwidget.families.vlm"],
]


def test_no_import_circles():
    assert [c for c in _cycles() if c not in KNOWN_CIRCLES] == []


def test_an_estimate_does_not_draw_itself():
    """Charts import results, never the other way: result and treemap know no chart code."""
    for name in ("vramwidget.result", "vramwidget.treemap"):
        assert "vramwidget.charts" not in GRAPH[name], name
    assert "vramwidget.result" in GRAPH["vramwidget.charts"]


def test_fit_is_pure_and_the_cli_holds_its_command_line():
    src = MODULES["vramwidget.fit"].read_text(encoding="utf-8")
    assert "argparse" not in src and "sys.stdout" not in src
    assert "vramwidget.cli" not in GRAPH["vramwidget.fit"]
    from vramwidget import cli

    assert callable(cli.fit_main) and callable(cli.add_fit_arguments)


def test_the_core_imports_no_widget_or_chart_code():
    core = ("vramwidget.architecture", "vramwidget.training", "vramwidget.activations",
            "vramwidget.estimate", "vramwidget.result", "vramwidget.parallel", "vramwidget.fit",
            "vramwidget.inference", "vramwidget.units", "vramwidget.gpus")
    for name in core:
        bad = {d for d in GRAPH[name] if d.startswith(("vramwidget.widget", "vramwidget.charts",
                                                       "vramwidget.chartview", "vramwidget.cli"))}
        assert not bad, (name, bad)


def test_the_widget_is_split_by_job():
    """One module per job (issue 10): state and traits, training, multi-GPU, inference,
    suggestions; each panel module is small enough to read top to bottom."""
    jobs = ("state", "training", "multigpu", "inference", "suggestions", "views", "calculator")
    for job in jobs:
        assert f"vramwidget.widget.{job}" in MODULES, job
    for name, path in MODULES.items():
        if name.startswith("vramwidget.widget."):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            assert lines <= 500, (name, lines)
    # panels do not import one another's internals through the calculator
    for job in ("training", "multigpu", "inference", "suggestions", "state", "views"):
        assert "vramwidget.widget.calculator" not in GRAPH[f"vramwidget.widget.{job}"], job


def test_the_frontend_is_one_file_per_panel():
    src = ROOT / "js" / "src"
    for panel in ("controls", "error", "summary", "suggestions", "charts", "table", "formats",
                  "parallel", "inference"):
        assert (src / f"{panel}.js").is_file(), panel
    entry = (src / "widget.js").read_text(encoding="utf-8")
    assert "embed(" not in entry and "replaceChildren" not in entry  # the entry only joins panels
