"""The house rules of vramwidget/ (issue 22), read from the source with ``ast``; nothing is imported.

1. No function longer than 150 lines and no class longer than 300 (``end_lineno - lineno + 1``,
   nested definitions counted on their own too).
2. No import circle between the package's modules.  Every ``import`` counts, also those inside
   functions; relative imports are resolved; a package's ``__init__`` stands for the package.
   ``from . import x`` is an import of the submodule ``x`` when there is one.
3. No module uses another module's private names: no ``from .x import _name`` and no
   ``x._name`` on a module bound by an import; and no code writes a private attribute of an
   object other than its own (``obj._name = ...`` where ``obj`` is not ``self``/``cls``; a
   module may set the private attributes its own classes set on ``self`` on other instances
   of them, and trace/kernels.py patches torch and transformers, listed in THIRD_PARTY_PATCHES).
   A private name is one that starts with one underscore (dunders are not private).

Tests under tests/ may use private names; these rules are for the package only.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vramwidget"

MAX_FUNCTION_LINES = 150
MAX_CLASS_LINES = 300


def _modules() -> Dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in MODULES.items()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _base(name: str, level: int, module: str | None) -> str:
    """The absolute module a ``from`` import in ``name`` names."""
    here = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    base = here[:len(here) - (level - 1)] if level else []
    return ".".join(base + ([module] if module else []))


def _imports(name: str) -> List[Tuple[str, str | None, str | None, int]]:
    """(module imported, name taken from it or None, local binding, line) for every import in
    ``name`` of a vramwidget module."""
    out = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.ImportFrom):
            target = _base(name, node.level, node.module)
            if not (target == "vramwidget" or target.startswith("vramwidget.")):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    out.append((sub, None, a.asname or a.name, node.lineno))
                else:
                    out.append((target, a.name, a.asname or a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    out.append((a.name, None, a.asname, node.lineno))
    return out


GRAPH: Dict[str, Set[str]] = {
    m: {t for t, _, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


# -- rule 1: sizes ---------------------------------------------------------------------------

def long_definitions() -> List[str]:
    found = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    found.append(f"{name}:{node.lineno} {kind} {node.name} {lines} lines (limit {limit})")
    return found


def test_no_long_functions_or_classes():
    assert long_definitions() == []


# -- rule 2: import circles ------------------------------------------------------------------

def cycles() -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a closed
    path of imports so a failure shows who imports whom."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
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
                found.append(_closed_path(set(comp)))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _closed_path(comp: Set[str]) -> List[str]:
    """One circle through the component's first module: a -> b -> ... -> a."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(GRAPH[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(comp)


def test_no_import_circles():
    found = cycles()
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


# -- rule 3: private names -------------------------------------------------------------------

def private_uses() -> List[str]:
    found = []
    for name, tree in TREES.items():
        module_aliases: Dict[str, str] = {}
        for target, taken, local, line in _imports(name):
            if taken is None:
                if local:
                    module_aliases[local] = target
            elif _is_private(taken) and target != name:
                found.append(f"{name}:{line} imports {target}.{taken}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                    and module_aliases[node.value.id] != name):
                found.append(f"{name}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}")
    return found


def _writes(tree: ast.AST):
    for node in ast.walk(tree):
        targets: List[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute):
                yield t, t.attr, t.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[1].value, node.args[0]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__setattr__" and len(node.args) >= 3
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[1].value, node.args[0]


#: modules that patch a third-party library's private attributes on purpose (each patch is
#: saved and put back when the traced step ends), and the objects they patch
THIRD_PARTY_PATCHES = {
    # the traced step (trace/kernels.py): torch.optim's _get_value, transformers' grouped-mm
    # check and torch.nn.Module._apply, so that a meta-device step runs the real kernels' paths
    "vramwidget.trace.kernels": {"mod", "moe", "torch.nn.Module"},
}


def _own_private_attributes(tree: ast.AST) -> Set[str]:
    """The private attributes a module's own classes use on ``self`` (``self._x``,
    ``getattr(self, "_x")``): the module may write them on other instances of its classes (a
    copy it makes, the allocator it resizes, a frozen setup it derives)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            own.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            own.add(node.args[1].value)
    return {a for a in own if _is_private(a)}


def private_writes() -> List[str]:
    """Writes of a private attribute onto anything but ``self``/``cls`` or an instance of the
    writing module's own classes (:func:`_own_private_attributes`)."""
    found = []
    for name, tree in TREES.items():
        own = _own_private_attributes(tree)
        for node, attr, owner in _writes(tree):
            if not _is_private(attr):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if attr in own or ast.unparse(owner) in THIRD_PARTY_PATCHES.get(name, ()):
                continue
            found.append(f"{name}:{node.lineno} writes {ast.unparse(owner)}.{attr}")
    return found


def test_no_private_names_across_modules():
    assert private_uses() == []


def test_nothing_writes_another_objects_private_attributes():
    assert private_writes() == []


def test_the_rules_see_what_they_check():
    """The readers find lazy imports and resolve relative ones (a check that found nothing
    would pass for the wrong reason)."""
    assert "vramwidget.fit" in GRAPH["vramwidget.cli"]  # cli imports fit inside its commands
    assert "vramwidget.charts" in GRAPH["vramwidget.chartview"]
    assert "vramwidget.tensors" in GRAPH["vramwidget.families.blocks"]  # ``from ..tensors import``
    snippet = ast.parse("est._replay_fn = f\nsetattr(est, '_work', w)\nself._ok = 1")
    assert {(a, ast.unparse(o)) for _, a, o in _writes(snippet)} == {
        ("_replay_fn", "est"), ("_work", "est"), ("_ok", "self")}
    assert "vramwidget.widget.compute" in GRAPH["vramwidget.widget.calculator"]  # ``from .compute import``


if __name__ == "__main__":
    for title, rows in (("long", long_definitions()), ("cycles", [" -> ".join(c) for c in cycles()]),
                        ("private uses", private_uses()), ("private writes", private_writes())):
        print(f"== {title}: {len(rows)}")
        for r in rows:
            print("  ", r)
