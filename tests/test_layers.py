"""The seams as code: the import graph of ``power_core`` and what plugins may import from it.

The graph is built from the source with :mod:`ast`, never by importing. **Every** import counts as an
edge, wherever it is written:

* ``module``: a statement that runs when the module is imported (top level, class bodies, ``try``);
* ``type_checking``: under ``if TYPE_CHECKING:`` — nothing runs, but the type checker (and the
  reader) still depends on the target, so it is an edge like any other;
* ``deferred``: inside a function or method body (and ``importlib.import_module("literal")`` calls):
  a postponed import is still a dependency — deferring it may make an import cheap, never a cycle legal.

Python's implicit import of a parent package (``import power_core.errors`` first runs
``power_core/__init__.py``) is package mechanics, not a dependency a module chose, so it is not an edge;
``from power_core import errors`` is an edge to ``power_core.errors`` (a submodule), ``from power_core
import Session`` an edge to ``power_core`` (the facade). What the plugin manager loads by name — the
entry points and :data:`power_core.plugins.BUILTIN_PLUGINS` — is discovery, not an import edge.

Rules: no cycle among ``power_core`` modules (any kind of edge); ``power_core`` never imports
``power_native`` or a plugin package; ``power_core.spec`` (the plugin vocabulary) depends only on
``runtime``, ``config`` and ``errors``; plugin packages import only :data:`PLUGIN_FACADES`, and
power-native only those plus :data:`NATIVE_EXTRA`.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "power_core"
#: packages outside the core: the core must never import them
FOREIGN = ("power_native", "power_mtp", "power_dflash", "power_dflash2", "power_dspark", "power_suffix")
#: the public facades a plugin may import (anything else in power_core is private and may change)
PLUGIN_FACADES = frozenset({
    "power_core",                      # the facade (Session, PowerConfig, errors, vocabulary)
    "power_core.spec",                 # plugin vocabulary: hookimpl, Strategy, Backend, requests
    "power_core.runtime",              # the seams: TargetRuntime, Proposer, DecodeResult, ...
    "power_core.errors",
    "power_core.config",
    "power_core.logs",                 # get_logger: Power's structured logging
    "power_core.artifacts",            # GGUF inspection, identity, binding (ArtifactView, ...)
    "power_core.artifacts.contracts",  # the validators' toolkit (Verified, reject, need_tensor, ...)
    "power_core.blockdraft",  # the DFlash family's one Strategy factory
    "power_core.testing",              # the conformance kit
})
#: power-native compiles against the pinned llama.cpp and shares its architecture table with the core
NATIVE_EXTRA = frozenset({"power_core.artifacts.archs"})
#: the plugin vocabulary is a leaf: it may use these core modules and nothing else of power_core
SPEC_DEPS = frozenset({"power_core.runtime", "power_core.config", "power_core.errors", "power_core.constraint"})
#: ... and what those use in turn (the configuration's keys, below PowerConfig; a constraint's key watcher)
SPEC_CLOSURE = SPEC_DEPS | {"power_core.config_keys", "power_core.json_keys"}
KINDS = ("module", "type_checking", "deferred")


@attrs.frozen
class Import:
    target: str  # dotted name as written (resolved for relative imports)
    names: tuple[str, ...]  # for ``from X import a, b``: ("a", "b"); () for ``import X``
    kind: str  # one of KINDS
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def parse_imports(source: str, module: str = "m", is_package: bool = False) -> list[Import]:
    """Every import statement of ``source``, classified as module-level, TYPE_CHECKING or deferred."""
    found: list[Import] = []

    def visit_stmt(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, (), kind, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            found.append(Import(target, tuple(a.name for a in node.names), kind, node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append(Import(node.args[0].value, (), "deferred", node.lineno))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "deferred" if kind == "module" else kind
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit_stmt(stmt, "type_checking" if kind == "module" else kind)
            for stmt in node.orelse:
                visit_stmt(stmt, kind)
            return
        for child in ast.iter_child_nodes(node):
            visit_stmt(child, kind)

    visit_stmt(ast.parse(source), "module")
    return found


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w.]+))", re.M)


def parse_cython_imports(source: str) -> list[Import]:
    """Imports and cimports of a ``.pyx``/``.pxd`` file (not Python: a line-based scan)."""
    out = []
    for m in _CYTHON_IMPORT.finditer(source):
        line = source.count("\n", 0, m.start()) + 1
        if m.group(1):
            names = tuple(n.strip(" ()").split(" as ")[0] for n in m.group(2).split(","))
            out.append(Import(m.group(1), tuple(n for n in names if n.isidentifier()), "module", line))
        else:
            out.append(Import(m.group(3), (), "module", line))
    return out


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules(package: Path = CORE) -> dict[str, Path]:
    return {module_name(p, package.parent): p for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}


def targets(imp: Import, known: Iterable[str]) -> set[str]:
    """The modules an import names: ``from pkg import sub`` is ``pkg.sub`` when that is a module, and
    ``import pkg.mod.attr`` (of something that is no module) is its nearest enclosing module."""
    known = set(known)
    subs = {f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in known}
    found = subs | ({imp.target} if not imp.names or len(subs) < len(imp.names) else set())
    out = set()
    for t in found:
        while t not in known and "." in t:
            t = t.rpartition(".")[0]
        out.add(t)
    return out


@attrs.frozen
class Graph:
    modules: frozenset[str]
    edges: Mapping[str, Mapping[str, tuple[Import, ...]]]  # module -> target -> the imports making it
    external: Mapping[str, tuple[Import, ...]]  # module -> imports of anything outside the package

    def deps(self, module: str, kinds: Iterable[str] = KINDS) -> set[str]:
        kinds = set(kinds)
        return {t for t, imps in self.edges[module].items() if any(i.kind in kinds for i in imps)}

    def adjacency(self, kinds: Iterable[str] = KINDS) -> dict[str, set[str]]:
        return {m: self.deps(m, kinds) for m in self.modules}

    def edge_count(self) -> int:
        return sum(len(t) for t in self.edges.values())


def build_graph(package: Path = CORE) -> Graph:
    mods = core_modules(package)
    name = package.name
    edges: dict[str, dict[str, list[Import]]] = {m: {} for m in mods}
    external: dict[str, list[Import]] = {m: [] for m in mods}
    for mod, path in mods.items():
        for imp in parse_imports(path.read_text(), mod, path.name == "__init__.py"):
            if imp.target != name and not imp.target.startswith(name + "."):
                external[mod].append(imp)
                continue
            for t in targets(imp, mods):
                if t != mod:
                    edges[mod].setdefault(t, []).append(imp)
    return Graph(frozenset(mods), {m: {t: tuple(i) for t, i in e.items()} for m, e in edges.items()},
                 {m: tuple(i) for m, i in external.items()})


def find_cycle(adjacency: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None when it is acyclic."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(adjacency, white)
    for start in sorted(adjacency):
        if color[start] != white:
            continue
        path = [start]
        stack = [iter(sorted(adjacency[start]))]
        color[start] = grey
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                color[path.pop()] = black
                stack.pop()
                continue
            state = color.get(nxt, black)  # an edge out of the graph cannot close a cycle
            if state == grey:
                return [*path[path.index(nxt):], nxt]
            if state == white:
                color[nxt] = grey
                path.append(nxt)
                stack.append(iter(sorted(adjacency[nxt])))
    return None


def describe_cycle(graph: Graph, cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        imp = graph.edges[a][b][0]
        steps.append(f"  {a} -> {b}   ({a.replace('.', '/')}.py:{imp.line}, {imp.kind})")
    return "import cycle:\n" + "\n".join(steps)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


# -- the graph is real ----------------------------------------------------------------------------


def test_graph_covers_the_core(graph):
    assert len(graph.modules) >= 40, sorted(graph.modules)
    assert graph.edge_count() >= 120
    for mod in ("power_core", "power_core.spec", "power_core.plugins", "power_core.session", "power_core.streaming",
                "power_core.serve", "power_core.serve.app", "power_core.reference.plugin", "power_core.artifacts.view"):
        assert mod in graph.modules
    # known edges of every kind, so a parser that finds nothing cannot pass
    assert "power_core.transaction" in graph.deps("power_core.session", ["module"])
    assert "power_core.hookspecs" in graph.deps("power_core.plugins", ["module"])
    assert "power_core.session" in graph.deps("power_core.serve.app", ["module"])
    assert "power_core.spec" in graph.deps("power_core.hookspecs", ["type_checking"])
    assert "power_core.receipt" in graph.deps("power_core.streaming", ["type_checking"])
    assert "power_core.session" in graph.deps("power_core.commands", ["deferred"])
    assert {"power_core.spec", "power_core.errors"} <= graph.deps("power_core.builtins") | graph.deps("power_core")


def test_parser_classifies_every_kind_of_import():
    src = textwrap.dedent("""
        from __future__ import annotations
        import os, pkg.a as pa
        from typing import TYPE_CHECKING
        from . import sibling
        from .sub import thing
        try:
            import fast
        except ImportError:
            fast = None
        if TYPE_CHECKING:
            from pkg.b import B
        else:
            import runtime_only
        class C:
            import in_class
            def method(self):
                from pkg.c import late
                importlib.import_module("pkg.d")
        async def f():
            if typing.TYPE_CHECKING:
                import nested_tc
    """)
    got = {(i.target, i.kind) for i in parse_imports(src, "pkg.mod", False)}
    assert got == {
        ("__future__", "module"), ("os", "module"), ("pkg.a", "module"), ("typing", "module"),
        ("pkg", "module"), ("pkg.sub", "module"), ("fast", "module"), ("pkg.b", "type_checking"),
        ("runtime_only", "module"), ("in_class", "module"), ("pkg.c", "deferred"), ("pkg.d", "deferred"),
        ("nested_tc", "deferred"),
    }
    assert {i.target for i in parse_imports("from .. import x", "pkg.sub.m", False)} == {"pkg"}
    assert {i.target for i in parse_imports("from .x import y", "pkg.sub", True)} == {"pkg.sub.x"}
    cy = parse_cython_imports("from power_native._llama cimport BatchExt, Context\nfrom power_core.errors import (X,\n"
                              "cimport numpy as cnp\n")
    assert [(i.target, i.names) for i in cy] == [("power_native._llama", ("BatchExt", "Context")),
                                                ("power_core.errors", ("X",)), ("numpy", ())]


def test_cycle_finder_finds_planted_cycles(graph):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    cycle = find_cycle({"d": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a", "x"}, "x": set()})
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"s": {"s"}}) == ["s", "s"]
    # the real graph plus one back edge: the leaf vocabulary importing the session
    adj = graph.adjacency()
    adj["power_core.spec"] = adj["power_core.spec"] | {"power_core.session"}
    cycle = find_cycle(adj)
    assert cycle is not None and "power_core.spec" in cycle and "power_core.session" in cycle
    # and the same through the parser: a TYPE_CHECKING import of the session in streaming is a cycle
    assert "power_core.streaming" in graph.deps("power_core.session")
    planted = parse_imports("if TYPE_CHECKING:\n    from power_core.session import Generation\n", "power_core.streaming")
    adj = graph.adjacency()
    adj["power_core.streaming"] |= {t for i in planted for t in targets(i, graph.modules)}
    assert find_cycle(adj) is not None


# -- the rules --------------------------------------------------------------------------------------


def test_no_import_cycles_in_power_core(graph):
    cycle = find_cycle(graph.adjacency())
    assert cycle is None, describe_cycle(graph, cycle)


def test_core_never_imports_native_or_plugins(graph):
    bad = [f"{m}:{i.line} imports {i.target}" for m, imps in graph.external.items() for i in imps
           if i.target.split(".")[0] in FOREIGN]
    assert not bad, bad


def test_spec_is_a_leaf(graph):
    assert graph.deps("power_core.spec") == SPEC_DEPS
    for dep in SPEC_CLOSURE:  # and those import no more of the core than each other
        assert graph.deps(dep) <= SPEC_CLOSURE, (dep, graph.deps(dep))


def test_manager_stream_and_hookspecs_stay_below_the_session(graph):
    def reach(mod: str) -> set[str]:
        seen, todo = set(), [mod]
        while todo:
            for d in graph.deps(todo.pop()) - seen:
                seen.add(d)
                todo.append(d)
        return seen

    for mod in ("power_core.plugins", "power_core.hookspecs", "power_core.streaming", "power_core.selection",
                "power_core.builtins", "power_core.reference.plugin", "power_core.observers"):
        assert "power_core.session" not in reach(mod), mod
    # the manager loads its built-ins by name (BUILTIN_PLUGINS), it does not import them
    assert not {"power_core.builtins", "power_core.reference.plugin"} & reach("power_core.plugins")
    from power_core.plugins import BUILTIN_PLUGINS
    assert {m for _, m in BUILTIN_PLUGINS} == {"power_core.builtins", "power_core.reference.plugin"}
    assert {m for _, m in BUILTIN_PLUGINS} <= graph.modules


def _package_imports(pkg_dir: Path) -> list[tuple[Path, Import]]:
    out = []
    root = pkg_dir.parent
    for path in sorted(pkg_dir.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        if path.suffix == ".py":
            imps = parse_imports(path.read_text(), module_name(path, root), path.name == "__init__.py")
        elif path.suffix in (".pyx", ".pxd"):
            imps = parse_cython_imports(path.read_text())
        else:
            continue
        out.extend((path, i) for i in imps)
    return out


def _facade_violations(pkg_dir: Path, allowed: frozenset[str], graph: Graph) -> list[str]:
    bad = []
    for path, imp in _package_imports(pkg_dir):
        if imp.target.split(".")[0] != "power_core":
            continue
        for t in targets(imp, graph.modules):
            if t not in allowed:
                bad.append(f"{path.relative_to(pkg_dir.parent)}:{imp.line} imports {t}")
    return bad


PLUGIN_PACKAGES = sorted(p for p in ROOT.glob("plugins/*/power_*") if p.is_dir() and not p.name.endswith(".egg-info"))


def test_plugins_are_found():
    assert {p.name for p in PLUGIN_PACKAGES} >= {"power_mtp", "power_dflash", "power_dflash2", "power_dspark",
                                                  "power_suffix"}


@pytest.mark.parametrize("pkg", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_plugins_import_only_public_facades(pkg, graph):
    imports = [i for _, i in _package_imports(pkg) if i.target.startswith("power_core")]
    assert imports, f"{pkg.name} imports nothing from power_core: the scan is broken"
    assert PLUGIN_FACADES <= graph.modules
    bad = _facade_violations(pkg, PLUGIN_FACADES, graph)
    assert not bad, f"{bad}: not public facades; import from one of {sorted(PLUGIN_FACADES)}"


def test_native_imports_only_public_facades(graph):
    pkg = ROOT / "native" / "src" / "power_native"
    assert any(i.target.startswith("power_core") for _, i in _package_imports(pkg))
    assert NATIVE_EXTRA <= graph.modules
    bad = _facade_violations(pkg, PLUGIN_FACADES | NATIVE_EXTRA, graph)
    assert not bad, f"{bad}: not public facades; import from one of {sorted(PLUGIN_FACADES | NATIVE_EXTRA)}"
    plugin_imports = [f"{p.relative_to(ROOT)}:{i.line} imports {i.target}" for p, i in _package_imports(pkg)
                      if i.target.split(".")[0] in FOREIGN and i.target.split(".")[0] != "power_native"]
    assert not plugin_imports  # plugins -> native -> core, never back


def test_facade_check_catches_a_private_import(tmp_path, graph):
    pkg = tmp_path / "power_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from power_core.spec import Strategy\nfrom power_core import errors\n")
    bad = _facade_violations(pkg, PLUGIN_FACADES, graph)
    assert not bad, f"{bad}: not public facades; import from one of {sorted(PLUGIN_FACADES)}"
    (pkg / "bad.py").write_text("def f():\n    from power_core.plugins import Strategy\n"
                                "from power_core import session\n")
    (pkg / "_ext.pyx").write_text("from power_core.transaction cimport X\n")
    bad = _facade_violations(pkg, PLUGIN_FACADES, graph)
    assert len(bad) == 3 and any("power_core.plugins" in b for b in bad)
    assert any("power_core.session" in b for b in bad) and any("power_core.transaction" in b for b in bad)


# -- the core names no first-party strategy -----------------------------------------------------------------
#: Power's own strategies: one per plugin package, and power-native's draft-model
FIRST_PARTY_STRATEGIES = frozenset({p.parent.name for p in ROOT.glob("plugins/*/pyproject.toml")} | {"draft-model"})
#: the one place the core may name them: (module, the table's name)
REGISTRATION_TABLE = ("spec.py", "FIRST_PARTY_PACKAGES")


def strategy_names_outside_table(source: str, filename: str, names: frozenset[str]) -> list[str]:
    """``file:line name`` for every string constant equal to one of ``names`` (docstrings aside), except
    inside the assignment of :data:`REGISTRATION_TABLE` in its module."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.add(id(body[0].value))  # a docstring describes; it does not branch on a name
        if filename == REGISTRATION_TABLE[0] and isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == REGISTRATION_TABLE[1] for t in targets):
                skip.update(id(n) for n in ast.walk(node))
    return [f"{filename}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in skip]


def test_power_core_names_no_first_party_strategy_outside_the_registration_table():
    """A strategy's keys, its place in ``auto`` and its package come from its registration (or the one
    table of first-party packages), never from a name written in the core."""
    assert {"mtp", "dflash", "dflash2", "dspark", "suffix", "draft-model"} <= FIRST_PARTY_STRATEGIES
    found = [hit for path in sorted(CORE.glob("*.py"))
             for hit in strategy_names_outside_table(path.read_text(), path.name, FIRST_PARTY_STRATEGIES)]
    assert not found, (f"{found}: power_core names a first-party strategy; declare it on the Strategy "
                       f"(config_keys, auto_detect, ...) or in {REGISTRATION_TABLE[1]} ({REGISTRATION_TABLE[0]})")


def test_the_registration_table_lists_every_first_party_strategy():
    from power_core.spec import FIRST_PARTY_PACKAGES

    assert set(FIRST_PARTY_PACKAGES) == FIRST_PARTY_STRATEGIES


def test_strategy_name_check_catches_a_name():
    names = frozenset({"mtp"})
    src = textwrap.dedent('''
        """Docstrings may say mtp."""
        FIRST_PARTY_PACKAGES = {"mtp": "power-mtp"}
        def f(mode):
            """mtp"""
            return mode == "mtp"
    ''')
    assert strategy_names_outside_table(src, "spec.py", names) == ["spec.py:6 'mtp'"]
    assert len(strategy_names_outside_table(src, "config.py", names)) == 2  # the table elsewhere is no table


# -- Generation's private state is its own ---------------------------------------------------------


def generation_privates(source: str) -> frozenset[str]:
    """The private names (``_x``, not dunders) that class ``Generation`` defines: fields and methods."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "Generation":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
    return frozenset(n for n in names if n.startswith("_") and not n.endswith("__"))


def private_reads(source: str, where: str, privates: frozenset[str]) -> list[str]:
    """``X._name`` for a private name of Generation, outside class Generation, where X is not ``self``."""
    tree = ast.parse(source)
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Generation":
            inside |= {id(n) for n in ast.walk(node)}
    return [f"{where}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in privates and id(n) not in inside
            and not (isinstance(n.value, ast.Name) and n.value.id == "self")]


def test_nothing_outside_generation_reads_its_private_attributes():
    """A driver runs a request through Generation's public interface (begin, prefill_done, charge,
    end, ...), never its private state: one owner for it."""
    privates = generation_privates((CORE / "generation.py").read_text())
    assert {"_prefilled", "_clock", "_decode_s", "_batch"} <= privates
    found = [hit for path in sorted(CORE.rglob("*.py"))
             for hit in private_reads(path.read_text(), str(path.relative_to(ROOT)), privates)]
    assert not found, f"{found}: use Generation's public interface"


def test_private_read_check_catches_a_read():
    privates = frozenset({"_prefilled"})
    src = textwrap.dedent('''
        class Generation:
            _prefilled: bool = False
            def resume(self, other):
                return other._prefilled and self._prefilled
        class Engine:
            def run(self, gen):
                return gen._prefilled
    ''')
    assert generation_privates(src) == privates
    assert private_reads(src, "engine.py", privates) == ["engine.py:8 ._prefilled"]
