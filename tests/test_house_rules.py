"""The house rules of vramwidget/ (issue 22), read from the source with ``ast``; nothing is imported.

1. No function longer than 150 lines and no class longer than 300 (``end_lineno - lineno + 1``,
   nested definitions counted on their own too).
2. No import circle between the package's modules.  Every ``import`` counts, also those inside
   functions; relative imports are resolved; a package's ``__init__`` stands for the package.
   ``from . import x`` is an import of the submodule ``x`` when there is one.
   A registry is an import too, the other way round: when module B writes into a module-level
   dict, list or set of module A (``A.TABLE[key] = f``, ``TABLE.update(...)`` on a name taken
   from A, ``.append``/``.setdefault``/...; ``@A.register`` or ``A.register(f)`` with a
   function or class of B, where ``register`` is a function of A that writes into A's table),
   A calls B's code without importing it: that counts as an edge A -> B for the circle check
   (B imports A to write into it, so such a registry always closes a circle).  The only
   exception is a declared plug-in point (PLUGIN_POINTS): a table that its registrants fill in
   and that never reaches any of them by imports, as the model families do
   (``model/families/base.py``'s REGISTRY, filled by ``@register`` in each family module; the
   package ``families/__init__`` imports them, ``base`` imports none of them).
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

_TABLE_CALLS = ("dict", "list", "set", "defaultdict", "OrderedDict")
_WRITE_METHODS = ("update", "setdefault", "append", "extend", "insert", "add", "__setitem__")

#: tables that are plug-in points: module -> why its registrants may fill it in (the test checks
#: that the module reaches none of its registrants by imports)
PLUGIN_POINTS = {
    # a model family is one module that registers itself (``@register``); model/families/base.py
    # looks families up by model_type and imports no family (docs/adding-a-model-family.md)
    "vramwidget.model.families.base": "the model families: each family module registers itself with @register",
}


def _tables(tree: ast.Module) -> Set[str]:
    """Module-level names bound to a dict, list or set (a literal, a comprehension or a call of
    dict/list/set/defaultdict/OrderedDict)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        table = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
            and (value.func.id if isinstance(value.func, ast.Name) else value.func.attr) in _TABLE_CALLS)
        if table:
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _written_tables(tree: ast.AST, refer) -> Set[str]:
    """The tables ``tree`` writes into; ``refer(expr)`` names the table an expression stands for
    (or None)."""
    out = set()
    for node in ast.walk(tree):
        targets: List[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and refer(t.value):
                out.add(refer(t.value))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _WRITE_METHODS and refer(node.func.value)):
            out.add(refer(node.func.value))
    return out


def _registering_functions(name: str) -> Set[str]:
    """Module-level functions of ``name`` that write into its own tables (``register``)."""
    tables = _tables(TREES[name])
    return {node.name for node in TREES[name].body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _written_tables(node, lambda e: e.id if isinstance(e, ast.Name) and e.id in tables else None)}


def _registry_index() -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """Each module's tables and registering functions."""
    return {m: _tables(TREES[m]) for m in MODULES}, {m: _registering_functions(m) for m in MODULES}


def _registrations(name: str, index: Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]) -> Set[str]:
    """The modules whose tables ``name`` fills in: writes into a table imported from (or reached
    through) another module, and registering functions of another module used as a decorator or
    called with one of this module's functions or classes (``index``: :func:`_registry_index`)."""
    tables, registering = index
    names: Dict[str, str] = {}     # local name -> module of a table taken from it
    funcs: Dict[str, str] = {}     # local name -> module of a registering function taken from it
    aliases: Dict[str, str] = {}   # local name -> module bound to it
    for target, taken, local, _ in _imports(name):
        if target == name or target not in MODULES:
            continue
        if taken is None:
            if local:
                aliases[local] = target
        elif taken in tables[target]:
            names[local] = target
        elif taken in registering[target]:
            funcs[local] = target

    def owner(e: ast.expr, pool: Dict[str, str], ok) -> str | None:
        if isinstance(e, ast.Name) and e.id in pool:
            return pool[e.id]
        if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in aliases
                and ok(aliases[e.value.id], e.attr)):
            return aliases[e.value.id]
        return None

    tree = TREES[name]
    out = _written_tables(tree, lambda e: owner(e, names, lambda m, a: a in tables[m]))
    own_defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    is_reg = lambda m, a: a in registering[m]  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in node.decorator_list:
                m = owner(d.func if isinstance(d, ast.Call) else d, funcs, is_reg)
                if m:
                    out.add(m)
        if isinstance(node, ast.Call) and any(
                isinstance(a, ast.Lambda) or (isinstance(a, ast.Name) and a.id in own_defs) for a in node.args):
            m = owner(node.func, funcs, is_reg)
            if m:
                out.add(m)
    return out - {name}


#: registry edges: table's module -> the modules that fill it in
REGISTRANTS: Dict[str, Set[str]] = {m: set() for m in MODULES}
_INDEX = _registry_index()
for _m in MODULES:
    for _a in _registrations(_m, _INDEX):
        REGISTRANTS[_a].add(_m)

#: the import graph with the registries' hidden calls (A -> B where B fills in A's table),
#: plug-in points left out
CALL_GRAPH: Dict[str, Set[str]] = {
    m: GRAPH[m] | (set() if m in PLUGIN_POINTS else REGISTRANTS[m]) for m in MODULES}


def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def cycles(graph: Dict[str, Set[str]] | None = None) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a closed
    path of imports so a failure shows who imports whom (``graph``: CALL_GRAPH, the imports
    and the registries)."""
    graph = CALL_GRAPH if graph is None else graph
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(_closed_path(set(comp), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _closed_path(comp: Set[str], graph: Dict[str, Set[str]]) -> List[str]:
    """One circle through the component's first module: a -> b -> ... -> a."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(comp)


def test_no_import_circles():
    found = cycles()
    assert found == [], "import circles (imports and registries): " + "; ".join(" -> ".join(c) for c in found)


def test_plug_in_points_import_none_of_their_registrants():
    """A declared plug-in point is filled in by modules it never reaches by imports (else its
    registry is a circle like any other); and the registry reader sees the families register."""
    for point in PLUGIN_POINTS:
        assert REGISTRANTS[point], point   # a plug-in point nobody fills in is not one
        assert not (_reach(GRAPH, point) & REGISTRANTS[point]), (point, _reach(GRAPH, point) & REGISTRANTS[point])
    assert {"vramwidget.model.families.llama", "vramwidget.model.families.t5"} <= REGISTRANTS["vramwidget.model.families.base"]
    # without the declaration the families' registry is a circle like any other
    undeclared = cycles({m: GRAPH[m] | REGISTRANTS[m] for m in MODULES})
    assert undeclared and all("vramwidget.model.families.base" in c for c in undeclared)


def test_the_registry_reader_sees_each_way_of_filling_a_table():
    """Each form of registration the rule names makes an edge A -> B, and a circle with B's import
    of A; a module's writes into its own tables (a cache) are no edge."""
    global TREES, MODULES
    saved = TREES, MODULES
    a = "TABLE = {}\nLIST: list = []\ndef register(f):\n    TABLE[f.__name__] = f\n    return f\n" \
        "def lookup(k):\n    TABLE.setdefault(k, 0)\n"
    forms = {
        "from .a import TABLE\ndef f(): pass\nTABLE['f'] = f\n",
        "from . import a\ndef f(): pass\na.TABLE.update(f=f)\n",
        "from .a import LIST\ndef f(): pass\nLIST.append(f)\n",
        "from .a import register\n@register\ndef f(): pass\n",
        "from . import a\n@a.register\nclass F: pass\n",
        "from .a import register\ndef f(): pass\nregister(f)\n",
    }
    try:
        for b in sorted(forms) + ["from .a import lookup, TABLE\nx = lookup('k')\ny = TABLE.get('k')\n"]:
            TREES = {"vramwidget.a": ast.parse(a), "vramwidget.b": ast.parse(b)}
            MODULES = {"vramwidget.a": PKG / "a.py", "vramwidget.b": PKG / "b.py"}
            assert _registrations("vramwidget.b", _registry_index()) == ({"vramwidget.a"} if b in forms else set()), b
            graph = {"vramwidget.a": {"vramwidget.b"} if b in forms else set(), "vramwidget.b": {"vramwidget.a"}}
            assert bool(cycles(graph)) == (b in forms), b
    finally:
        TREES, MODULES = saved


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
    assert "vramwidget.fit.solver" in GRAPH["vramwidget.cli"]  # cli imports fit inside its commands
    assert "vramwidget.show.charts" in GRAPH["vramwidget.show.chartview"]
    assert "vramwidget.model.tensors" in GRAPH["vramwidget.model.families.blocks"]  # ``from ..tensors import``
    snippet = ast.parse("est._replay_fn = f\nsetattr(est, '_work', w)\nself._ok = 1")
    assert {(a, ast.unparse(o)) for _, a, o in _writes(snippet)} == {
        ("_replay_fn", "est"), ("_work", "est"), ("_ok", "self")}
    assert "vramwidget.widget.compute" in GRAPH["vramwidget.widget.calculator"]  # ``from .compute import``


if __name__ == "__main__":
    for title, rows in (("long", long_definitions()), ("cycles", [" -> ".join(c) for c in cycles()]),
                        ("registries", [f"{a} <- {', '.join(sorted(b))}" for a, b in REGISTRANTS.items() if b]),
                        ("private uses", private_uses()), ("private writes", private_writes())):
        print(f"== {title}: {len(rows)}")
        for r in rows:
            print("  ", r)
