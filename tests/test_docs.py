"""Every public function and class of the package has a docstring (issue 5: docs for every
public function), and the README's commands exist."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

MODULES = ["model.architecture", "estimate", "training", "result", "measure.validate", "fit.scenarios", "fit.solver",
           "parallel.estimate", "parallel.strategies", "inference.estimate", "inference", "show.chartview", "widget", "show.charts",
           "show.treemap", "gpus", "model.presets", "model.hub", "measure.training", "measure.inference",
           "cli", "fit.verdict", "fit.fitmap", "widget.state", "widget.training", "widget.multigpu", "widget.inference",
           "widget.suggestions", "widget.views", "widget.formats", "widget.calculator", "widget.options",
           "widget.verdictpanel", "widget.controls",
           "units", "errors", "model.activations", "model.families",
           "model", "show", "measure", "parallel", "fit", "allocator"]
# every family module too (vramwidget/model/families/*.py)
MODULES += ["model.families." + p.stem for p in
            sorted((Path(__file__).parent.parent / "vramwidget" / "model" / "families").glob("*.py"))
            if p.stem != "__init__"]


@pytest.mark.parametrize("modname", MODULES)
def test_public_api_is_documented(modname):
    m = importlib.import_module("vramwidget." + modname)
    assert inspect.getdoc(m), modname
    missing = []
    for name, obj in vars(m).items():
        if name.startswith("_") or getattr(obj, "__module__", "") != m.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            if not inspect.getdoc(obj):
                missing.append(name)
            if inspect.isclass(obj):
                missing += [f"{name}.{k}" for k, v in vars(obj).items()
                            if not k.startswith("_") and inspect.isfunction(v) and not inspect.getdoc(v)]
    assert not missing, missing


def test_readme_commands_exist():
    """Each `vramwidget <command>` the README shows is a real subcommand."""
    from vramwidget.cli import build_parser

    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    used = set(re.findall(r"^vramwidget (\w+)", readme, flags=re.M))
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert used and used <= set(sub.choices), used - set(sub.choices)


def test_readme_seven_b_activation_range_matches_the_code():
    """The README quotes the 7B scenario's activations without checkpointing (issue 14: it said
    100-180 GB while the code gives 103.6 and 183.3 GB)."""
    import re

    from vramwidget.fit.scenarios import seven_b_fp32_vs_bf16

    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    lo, hi = map(int, re.search(r"activations alone are (\d+)-(\d+) GB", readme).groups())
    acts = [r["activations_gb"] for r in seven_b_fp32_vs_bf16()["rows"] if r["checkpointing"] == "none"]
    assert (lo, hi) == (round(min(acts)), round(max(acts)))


def test_readme_says_to_make_a_venv_first():
    """Debian's Python refuses `pip install` outside a venv (externally-managed-environment)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    block = readme.split("## The two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [x for x in block.strip().splitlines() if x.strip()]
    assert lines[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    assert lines[1].startswith("pip install -e . && vramwidget estimate")
