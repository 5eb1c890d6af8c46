"""The library's layout, measured from its source: rooms (the packages of ``swarm/``), the arrows between them,
import circles, private names reached across modules, the longest classes.

Run it as a script for the report (``python tests/test_layout.py``; ``--json`` for machine-readable output); as a
test it holds the layout's rules (docs/architecture.md, "Rooms"):

* no import circle among the library's modules (every ``import`` counts, also one inside a function or under
  ``TYPE_CHECKING``: a circle hidden in a function is still a circle);
* no module takes a private name (``_name``) from another module, nor reads one off another object
  (``other._name``; ``self._name`` and ``cls._name`` are a class's own);
* no class over :data:`MAX_CLASS_LINES` lines;
* at most :data:`MAX_TOP_MODULES` modules at the top of ``swarm/`` besides its ``__init__``;
* the rooms' arrows follow :data:`ROOM_ORDER` (a room imports only rooms below it), and the library never
  imports the apps.
"""

from __future__ import annotations

import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "swarm"
MAX_CLASS_LINES = 300
MAX_TOP_MODULES = 8
ROOM_ORDER = ["config", "settings", "identity", "swarm", "aio", "protocol", "host", "logs", "metrics", "kernels", "model", "data",
              "net", "trust", "checkpoint", "averaging", "server", "trainer", "reference", "attacks"]
"""Rooms from the ground up; a room imports only rooms before it in this list. A package of ``swarm/`` is a room,
and so is each module at its top (``swarm`` is the package's own ``__init__``: its version and public names).
``reference`` and ``attacks`` sit above the roles they drive."""
THIRD_PARTY_PRIVATE_ROOM = "averaging"
"""The one room allowed to touch a third party's private names (hivemind's, behind small classes of ours)."""
THIRD_PARTY_PRIVATE_READS = {"_version"}
"""Private attributes of a third party read elsewhere, each with its reason: ``Tensor._version``, torch's in-place
version counter (autograd's own test for a stale saved tensor; torch has no public accessor), read by the stage
server to tell a cached graph whose parameters an optimizer step changed."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_modules() -> dict[str, Path]:
    """Dotted name -> path of every module of the library (a package's ``__init__`` is the package's name)."""
    return {module_name(p): p for p in sorted((ROOT / LIBRARY).rglob("*.py"))}


def room_of(module: str) -> str:
    """The room a module lives in: its package under ``swarm/`` (``swarm.net.directory`` -> ``net``), its own name
    for a module at the top (``swarm.config`` -> ``config``), ``swarm`` for the package's ``__init__``."""
    parts = module.split(".")
    return "swarm" if len(parts) == 1 else parts[1]


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> set[str]:
    """The library modules an ``import`` of ``names`` from ``target`` runs: a name that is a submodule is that
    module, any other name the package or module ``target`` itself."""
    found = set()
    for name in names:
        sub = f"{target}.{name}"
        if sub in modules:
            found.add(sub)
        elif target in modules:
            found.add(target)
    return found


def _relative(module: str, path: Path, level: int, target: str | None) -> str:
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports(modules: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """module -> {imported library module -> names taken from it}, every import statement of the file."""
    edges: dict[str, dict[str, set[str]]] = {}
    for module, path in modules.items():
        out: dict[str, set[str]] = defaultdict(set)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == LIBRARY and alias.name in modules:
                        out[alias.name].add("*module*")
            elif isinstance(node, ast.ImportFrom):
                target = _relative(module, path, node.level, node.module) if node.level else node.module
                if target is None or target.split(".")[0] != LIBRARY:
                    continue
                names = [a.name for a in node.names]
                for hit in _resolve(target, names, modules):
                    out[hit].update(n for n in names if f"{target}.{n}" != hit)
        out.pop(module, None)
        edges[module] = dict(out)
    return edges


def circles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def private_reaches(modules: dict[str, Path]) -> list[str]:
    """``module:line what`` for every private name taken from another library module or read off another object.

    Reading ``other._name`` is a module's own business where that module defines ``_name`` (as ``self._name``, a
    class attribute or a marker it sets): objects of its own classes. A third party's private names count too,
    except inside :data:`THIRD_PARTY_PRIVATE_ROOM`, where hivemind's are fenced, and
    :data:`THIRD_PARTY_PRIVATE_READS`."""
    found = []
    for module, path in modules.items():
        room, tree = room_of(module), ast.parse(path.read_text(), str(path))
        own = _defined_private(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if _private(alias.name) and (node.module.split(".")[0] == LIBRARY or
                                                 room != THIRD_PARTY_PRIVATE_ROOM):
                        found.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                    continue
                if room == THIRD_PARTY_PRIVATE_ROOM or node.attr in own or node.attr in THIRD_PARTY_PRIVATE_READS:
                    continue
                found.append(f"{module}:{node.lineno} reads {ast.unparse(owner)}.{node.attr}")
    return found


def _defined_private(tree: ast.Module) -> set[str]:
    """Private attribute names a module defines: assigned on any object (``self._x = ...``, ``marker._x = ...``)
    or in a class body (attributes and methods)."""
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return {n for n in names if _private(n)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def class_lines(modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(lines, module.Class)`` of every class, longest first."""
    rows = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                rows.append((node.end_lineno - node.lineno + 1, f"{module}.{node.name}"))
    return sorted(rows, reverse=True)


def room_arrows(edges: dict[str, dict[str, set[str]]]) -> dict[tuple[str, str], int]:
    """(room, room it imports) -> number of module-level arrows between them."""
    arrows: dict[tuple[str, str], int] = defaultdict(int)
    for module, targets in edges.items():
        for target in targets:
            a, b = room_of(module), room_of(target)
            if a != b:
                arrows[(a, b)] += 1
    return dict(sorted(arrows.items()))


def upward(arrows: dict[tuple[str, str], int]) -> list[str]:
    """Arrows that run against :data:`ROOM_ORDER` (or name a room it lacks)."""
    rank = {room: i for i, room in enumerate(ROOM_ORDER)}
    return [f"{a} -> {b}" for a, b in arrows if a not in rank or b not in rank or rank[b] >= rank[a]]


def top_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / LIBRARY).glob("*.py") if p.name != "__init__.py")


def app_imports(modules: dict[str, Path]) -> list[str]:
    """``module:line`` where the library imports an app (``peer``, ``coordinator``) or a benchmark or test."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{module}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in ("peer", "coordinator", "bench", "tests")]
    return found


def report() -> dict:
    modules = library_modules()
    edges = imports(modules)
    arrows = room_arrows(edges)
    rooms = defaultdict(list)
    for module in modules:
        rooms[room_of(module)].append(module)
    return dict(
        rooms={room: sorted(ms) for room, ms in sorted(rooms.items())},
        arrows={f"{a} -> {b}": n for (a, b), n in arrows.items()},
        arrows_upward=upward(arrows),
        circles=circles(edges),
        private_reaches=private_reaches(modules),
        app_imports=app_imports(modules),
        top_modules=top_modules(),
        longest_classes=[f"{n} {name}" for n, name in class_lines(modules)[:8]],
    )


# ---- the rules -------------------------------------------------------------------------------------------------
def test_no_import_circle():
    modules = library_modules()
    assert circles(imports(modules)) == []


def test_no_private_name_reached_across_modules():
    assert private_reaches(library_modules()) == []


def test_no_class_over_the_limit():
    longest = [(n, name) for n, name in class_lines(library_modules()) if n > MAX_CLASS_LINES]
    assert longest == [], f"classes over {MAX_CLASS_LINES} lines"


def test_few_modules_at_the_top():
    assert len(top_modules()) <= MAX_TOP_MODULES, top_modules()


def test_rooms_import_downward_only():
    modules = library_modules()
    assert upward(room_arrows(imports(modules))) == []
    assert set(room_of(m) for m in modules) <= set(ROOM_ORDER)


def test_library_never_imports_the_apps():
    assert app_imports(library_modules()) == []


def test_no_script_folder_is_on_the_import_path():
    """Every test module has been imported (collection comes first): none put ``bench/`` itself on ``sys.path``,
    where its ``kernels.py`` shadows the PyPI package ``kernels`` that transformers imports when it finds one."""
    folders = {str(ROOT / name) for name in ("bench", "bench/sim", "peer", "coordinator", "docker")}
    assert [p for p in sys.path if p and str(Path(p).resolve()) in folders] == []


def test_the_analysis_sees_a_circle_and_a_private_reach(tmp_path, monkeypatch):
    """The checks can fail: a made-up library with a circle and a private reach is caught."""
    lib = tmp_path / LIBRARY
    (lib / "a").mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "a" / "__init__.py").write_text("")
    (lib / "a" / "x.py").write_text("from swarm.a.y import _hidden\n")
    (lib / "a" / "y.py").write_text("def f(o):\n    from swarm.a import x\n    return o._inner\n_hidden = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = library_modules()
    assert circles(imports(modules)) == [["swarm.a.x", "swarm.a.y"]]
    assert [r.split(" ", 1)[1] for r in private_reaches(modules)] == ["imports swarm.a.y._hidden", "reads o._inner"]


if __name__ == "__main__":
    figures = report()
    if "--json" in sys.argv:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key}:")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                print(f"  {k}: {v}" if isinstance(value, dict) else f"  {v}")
