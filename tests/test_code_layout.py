"""The shape of the code: a pure core, the widget split by job (no import circles: test_house_rules).

Imports are read from the source (every ``import`` statement, also those inside functions,
which a run-time check would miss), so a lazy import that closes a circle fails here too.
"""

from __future__ import annotations

from test_house_rules import GRAPH, MODULES, ROOT  # the one reader of the import graph (no circles: there)


def test_an_estimate_does_not_draw_itself():
    """Charts import results, never the other way: result and treemap know no chart code."""
    for name in ("vramwidget.result", "vramwidget.show.treemap"):
        assert "vramwidget.show.charts" not in GRAPH[name], name
    assert "vramwidget.result" in GRAPH["vramwidget.show.charts"]


def test_fit_is_pure_and_the_cli_holds_its_command_line():
    src = MODULES["vramwidget.fit.solver"].read_text(encoding="utf-8")
    assert "argparse" not in src and "sys.stdout" not in src
    assert "vramwidget.cli" not in GRAPH["vramwidget.fit.solver"]
    from vramwidget import cli

    assert callable(cli.fit_main) and callable(cli.add_fit_arguments)


def test_the_core_imports_no_widget_or_chart_code():
    core = ("vramwidget.model.architecture", "vramwidget.training", "vramwidget.model.activations",
            "vramwidget.estimate", "vramwidget.result", "vramwidget.parallel.estimate", "vramwidget.fit.solver",
            "vramwidget.inference.estimate", "vramwidget.units", "vramwidget.gpus")
    for name in core:
        bad = {d for d in GRAPH[name] if d.startswith(("vramwidget.widget", "vramwidget.show.charts",
                                                       "vramwidget.show.chartview", "vramwidget.cli"))}
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


def test_every_benchmark_and_tool_imports_what_exists():
    """The scripts run by hand (benchmarks/, tools/) import the package as it is laid out now:
    every ``from vramwidget... import name`` resolves (after the layout change of issue 22,
    bench_widget_update.py still imported ``vramwidget.events``)."""
    import ast
    import importlib

    bad = []
    for folder in ("benchmarks", "tools"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vramwidget"):
                    try:
                        mod = importlib.import_module(node.module)
                    except ImportError as e:
                        bad.append(f"{path.name}:{node.lineno}: {node.module} ({e})")
                        continue
                    for alias in node.names:
                        if not hasattr(mod, alias.name):
                            try:
                                importlib.import_module(f"{node.module}.{alias.name}")
                            except ImportError:
                                bad.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("vramwidget"):
                            try:
                                importlib.import_module(alias.name)
                            except ImportError as e:
                                bad.append(f"{path.name}:{node.lineno}: {alias.name} ({e})")
    assert not bad, bad
