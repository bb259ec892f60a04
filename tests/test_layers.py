"""The package's layer order (docs/architecture.md): no import circle, and no import that runs up.

Every module under lmcli/ is parsed with `ast`, and every import counts: at module level, inside
functions, under `if TYPE_CHECKING:`, and `importlib.import_module("lmcli....")` with a string literal.
`import lmcli` then `lmcli.load` (or `from lmcli import load`) reaches the package's lazy facade, so it
counts as an import of the module the facade's `_LAZY` table names for that attribute. An import of a package counts as one of its
`__init__.py`.

LAYERS is the order, lowest first, in the package names of the folder layout that docs/architecture.md
describes. A module belongs to the layer of its longest listed prefix; it may import its own layer and
the layers below, never one above (KNOWN_EXCEPTIONS lists the edges still to remove, each with why).
OLD_NAMES maps a module's name before the folder layout to its name after, so the same order is checked
on either layout; the relayout script empties it once the files have moved.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. Each entry: the layer's name (as docs/architecture.md names it) and its module prefixes.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("lmcli.errors", "lmcli.paths", "lmcli.machine", "lmcli.threads", "lmcli.config", "lmcli.registry")),
    ("io", ("lmcli.io",)),
    ("settings", ("lmcli.settings",)),
    ("resolve", ("lmcli.resolve",)),
    ("kernels", ("lmcli.kernels", "lmcli.native")),
    ("models", ("lmcli.models",)),
    ("distributed", ("lmcli.distributed",)),
    ("generation", ("lmcli.generation",)),
    ("loading", ("lmcli.loading",)),
    ("console", ("lmcli.console",)),
    ("jobs", ("lmcli.jobs",)),
    ("chat", ("lmcli.chat",)),
    ("serve", ("lmcli.serve",)),
    ("bench", ("lmcli.bench",)),
    ("commands", ("lmcli.cli", "lmcli.command_group", "lmcli.__main__", "lmcli")),
]

# Imports that still run up, by (importing prefix, imported prefix): each is to be removed, not extended.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

# BEGIN OLD NAMES (relayout.py empties this dict once the files have moved)
OLD_NAMES: dict[str, str] = {}
# END OLD NAMES


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in (root / "lmcli").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _lazy_facade(root: Path = ROOT) -> dict[str, str]:
    """lmcli/__init__.py's `_LAZY`: attribute -> the module it comes from."""
    for node in ast.parse((root / "lmcli" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {name: module for name, (module, _) in ast.literal_eval(node.value).items()}
    return {}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, every kind of import counted (old names as found)."""
    modules, facade = _modules(root), _lazy_facade(root)

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        # `import lmcli` then `lmcli.load(...)`: the facade's lazy attribute is an import of its module
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "lmcli" and node.attr in facade}
        for node in ast.walk(tree):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
                if any(alias.name == "lmcli" for alias in node.names):
                    found += [facade[attr] for attr in used]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    parent = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parent[: len(parent) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    if base == "lmcli" and alias.name in facade:
                        found.append(facade[alias.name])
                    else:
                        found.append(f"{base}.{alias.name}")
            elif isinstance(node, ast.Call) and "import_module" in (getattr(node.func, "attr", None),
                                                                    getattr(node.func, "id", None)) \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found = [node.args[0].value]
            for target in found:
                if target == "lmcli" or target.startswith("lmcli."):
                    module = owner(target)
                    if module and module != name and not name.startswith(module + "."):  # a package's own __init__
                        targets.add(module)
        graph[name] = targets
    return graph


def new_name(module: str) -> str:
    """A module's name in the folder layout (itself where it already has it)."""
    return OLD_NAMES.get(module, module)


def layer_of(module: str) -> int:
    """The index in LAYERS of the module's longest listed prefix (the package itself, "lmcli", only by
    name: a module nobody placed has no layer); -1 for none."""
    best, index = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != "lmcli" and module.startswith(prefix + "."))
            if inside and len(prefix) > best:
                best, index = len(prefix), i
    return index


def _exception(source: str, target: str) -> bool:
    return any((source == a or source.startswith(a + ".")) and (target == b or target.startswith(b + "."))
               for a, b in KNOWN_EXCEPTIONS)


def test_every_module_has_a_layer():
    unplaced = sorted(new_name(m) for m in _modules() if layer_of(new_name(m)) < 0)
    assert not unplaced, f"modules in no layer of LAYERS (place them, and in docs/architecture.md): {unplaced}"


def test_no_import_circle():
    """No circle, leaving out the KNOWN_EXCEPTIONS edges (each of which closes one until it is removed)."""
    graph = {source: {t for t in targets if not _exception(new_name(source), new_name(t))}
             for source, targets in import_graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(", ".join(c) for c in circles)
    assert "lmcli.cli" in graph and len(graph) > 40  # the walk saw the package


def test_no_import_runs_up_the_layers():
    upward: list[str] = []
    used: set[tuple[str, str]] = set()
    for source, targets in import_graph().items():
        for target in targets:
            a, b = new_name(source), new_name(target)
            if layer_of(b) > layer_of(a):
                if _exception(a, b):
                    used.update(pair for pair in KNOWN_EXCEPTIONS
                                if a.startswith(pair[0]) and b.startswith(pair[1]))
                    continue
                upward.append(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    assert not upward, "imports against the layer order (docs/architecture.md):\n" + "\n".join(sorted(upward))
    stale = set(KNOWN_EXCEPTIONS) - used
    assert not stale, f"KNOWN_EXCEPTIONS lists edges no import makes any more (remove them): {sorted(stale)}"


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The parser itself, on a package written here: lazy, TYPE_CHECKING, importlib and facade imports."""
    package = tmp_path / "lmcli"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text('_LAZY = {"load": ("lmcli.top", "load")}\n')
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmcli.top import x\n")
    (package / "low" / "b.py").write_text("def f():\n    import lmcli.top\n")
    (package / "low" / "c.py").write_text("import importlib\nm = importlib.import_module('lmcli.top')\n")
    (package / "low" / "d.py").write_text("def f():\n    import lmcli\n    return lmcli.load\n")
    (package / "low" / "f.py").write_text("import lmcli\nHERE = lmcli.__file__\n")  # no lazy attribute
    (package / "low" / "e.py").write_text("from . import a\nfrom .a import x\n")
    (package / "top.py").write_text("from lmcli.low import a\n")
    graph = import_graph(tmp_path)
    for module in ("lmcli.low.a", "lmcli.low.b", "lmcli.low.c", "lmcli.low.d"):
        assert graph[module] == {"lmcli.top"}, module
    assert graph["lmcli.low.e"] == {"lmcli.low.a"}
    assert graph["lmcli.low.f"] == set()
    assert graph["lmcli.top"] == {"lmcli.low.a"}


def test_the_documents_state_the_layers_and_the_module_count():
    """docs/architecture.md lists the layers in this order; the README states how many top-level modules there are."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    assert order, "docs/architecture.md has no <!-- layers --> ... <!-- /layers --> list"
    documented = re.findall(r"^\d+\. \*\*(\w+)\*\*", order.group(1), re.M)
    assert documented == [name for name, _ in LAYERS]
    count = re.search(r"(\d+) top-level modules", (ROOT / "README.md").read_text())
    assert count, "README.md does not state the number of top-level modules"
    assert int(count.group(1)) == len(_top_level_after_relayout()), _top_level_after_relayout()


def _top_level_after_relayout() -> list[str]:
    """The .py files directly in lmcli/ once the folder layout is in place (old names mapped)."""
    names = set()
    for module, path in _modules().items():
        new = new_name(module)
        if module == "lmcli" or path.name == "__init__.py":
            continue
        if new.count(".") == 1:
            names.add(new.split(".")[1])
    return sorted(names | {"__init__"})
