"""The house rules of the package, read from its source: only the backend and models/
touch transformers beyond tokenizer/config types; nothing outside the drafters and the
engine builder inspects drafter classes; the folders are the import paths; only
ragspec.loading builds engines; and the import graph (every ``import``/``from`` of the
package's modules, inside functions too, relative imports resolved, not those under ``if
TYPE_CHECKING:``) has no cycle, points down the house's floors only (:data:`FLOORS`),
places every module on a floor, and takes no other package's private names
(:func:`private_imports`). The graph checks are functions of a folder, tested on planted
trees at the end."""

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import ragspec

PACKAGE = Path(ragspec.__file__).parent
ALLOWED_TRANSFORMERS = {
    "AutoTokenizer",
    "PreTrainedTokenizerBase",
    "PreTrainedTokenizerFast",
    "PretrainedConfig",
    "AutoConfig",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_only_the_backend_and_models_import_transformers_internals():
    offenders = []
    for rel, tree in _modules():
        if rel.startswith(("backend/", "models/")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [f"{rel}: import {a.name}" for a in node.names if a.name.split(".")[0] == "transformers"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                names = {a.name for a in node.names}
                if node.module != "transformers" or not names <= ALLOWED_TRANSFORMERS:
                    offenders.append(f"{rel}: from {node.module} import {sorted(names)}")
    assert offenders == []


DRAFTER_CLASSES = {
    "Drafter",
    "DraftSession",
    "CompositeDrafter",
    "PromptLookupDrafter",
    "SelectingDrafter",
    "MergedDrafter",
    "EagleDrafter",
    "DatastoreDrafter",
}


def test_no_isinstance_on_drafter_classes_outside_the_drafters_and_the_builder():
    offenders = []
    for rel, tree in _modules():
        if rel.startswith("drafters/") or rel == "loading.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(c, "id", getattr(c, "attr", None)) for c in classes}
                if names & DRAFTER_CLASSES:
                    offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_every_package_folder_is_an_import_path():
    # each folder holding Python modules has an __init__.py, so ragspec.x.y is the folder x/y
    for folder in {p.parent for p in PACKAGE.rglob("*.py")}:
        assert (folder / "__init__.py").is_file(), folder
    import ragspec.backend.hf  # noqa: F401
    import ragspec.datastore
    import ragspec.integrations

    assert Path(ragspec.datastore.__file__).parent == PACKAGE / "datastore"
    assert Path(ragspec.integrations.__file__).parent == PACKAGE / "integrations"


def _scripts_and_examples():
    """The repository's scripts and examples beside the package (none when it is installed)."""
    for folder in ("scripts", "examples"):
        for path in sorted((PACKAGE.parent / folder).glob("*.py")):
            yield f"{folder}/{path.name}", ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_engine_is_built_only_by_the_loader():
    """Front ends, scripts and examples build engines through ragspec.loading: no module
    outside it calls ``Engine(`` (nor, outside the backend, ``HFTarget(``) or sets an
    engine attribute after construction."""
    offenders = []
    for rel, tree in [*_modules(), *_scripts_and_examples()]:
        if rel in ("loading.py", "engine.py"):
            continue
        for node in ast.walk(tree):
            called = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
            if called == "Engine" or (called == "HFTarget" and not rel.startswith("backend/")):
                offenders.append(f"{rel}:{node.lineno} {called}(...)")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in ("engine", "variant")
                    ):
                        offenders.append(f"{rel}:{node.lineno} {t.value.id}.{t.attr} = ...")
    assert offenders == []


# ---------------------------------------------------------------------------- import graph
# The house's floors, lowest first: core -> backend -> drafters -> loop -> front ends and
# bench. A module imports only modules of its own floor or a lower one; there are no
# cycles. Folders are floors: each name is a module of the package's top folder or one of
# its sub-folders (a package), and a sub-folder's floor is that of every module in it, at
# any depth ("" is the package's own __init__, on the front ends' floor). Nothing inside a
# sub-folder is placed by its own name: a command module left in a drafter folder sits on
# the drafters' floor, and its imports of the loop point up (:func:`floor_of`).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "types",
            "errors",
            "config",
            "tree",
            "verify",
            "sampling",
            "policy",
            "detok",
            "jsonl",
            "prefix_cache",
            "progress",
            "params",
            "deprecation",
            "processors",
            "logit_processors",
            "processing",
            "logprobs",
            "specbench",
            "structured",
            "grammar",
            "grouping",
            "scheduling",
        ),
    ),
    ("backend", ("models", "calibrate", "calibration_cache", "backend")),
    ("drafters", ("drafters", "drafting", "eagle", "datastore")),
    (
        "loop",
        ("prompts", "request", "prefill", "draft_choice", "composition", "stepping", "engine", "loading", "serving"),
    ),
    # the front ends: the command line, the integrations, EAGLE training, the measuring wing
    # (and the deprecated old paths of ragspec.cli.common and ragspec.cli.doctor)
    ("top", ("", "__main__", "cli", "integrations", "training", "bench", "cli_common", "doctor")),
)


@dataclass(frozen=True)
class Edge:
    """One import of a package module by another: ``source`` imports ``target`` (dotted
    names) at ``line``; ``names``: the names a ``from target import ...`` takes that are
    not modules themselves (empty for ``import target``)."""

    source: str
    target: str
    line: int
    names: tuple[str, ...] = ()


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package folder ``root / package``: dotted name -> file (a
    package's ``__init__.py`` is named after the package)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = (package, *path.relative_to(root / package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[Union[ast.Import, ast.ImportFrom]]:
    """Every import statement under ``node``, inside functions and classes too, except
    those in the body of ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    for child in ast.iter_child_nodes(node):
        counted = child.orelse if isinstance(child, ast.If) and _is_type_checking(child.test) else [child]
        for statement in counted:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                yield statement
            else:
                yield from _import_nodes(statement)


def import_graph(root: Path, package: str) -> dict[str, list[Edge]]:
    """The package's import graph read from its source: for each module, its imports of
    the package's modules (relative imports resolved; ``from m import x`` is an import of
    the module ``m.x`` where that is a module, else of ``m``; an import of a name the
    package does not hold is an edge to that name, which then has no floor)."""
    modules = package_modules(root, package)
    graph: dict[str, list[Edge]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = []
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [(a.name, ()) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                found = []
                plain = []
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        found.append((f"{base}.{a.name}", ()))
                    else:
                        plain.append(a.name)
                if plain or not found:
                    found.append((base, tuple(plain)))
            for target, names in found:
                if (target == package or target.startswith(package + ".")) and target != name:
                    edges.append(Edge(name, target, node.lineno, names))
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules, as a path that starts and ends
    at the group's first module by name: ``[a, b, a]`` when ``a`` imports ``b`` and ``b``
    imports ``a`` (a shortest such path)."""
    succ = {m: sorted({e.target for e in es}) for m, es in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                connect(w)
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
                groups.append(sorted(group))

    for v in sorted(succ):
        if v not in index:
            connect(v)
    cycles = []
    for group in sorted(groups):
        start, inside = group[0], set(group)
        came: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in came:  # breadth first: a shortest way back
            nxt = []
            for v in frontier:
                for w in succ[v]:
                    if w in inside and w not in came:
                        came[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(came[path[-1]])
        cycles.append(path[::-1])
    return cycles


def floor_of(module: str, package: str, floors=FLOORS) -> Optional[int]:
    """The floor (index into ``floors``, lowest first) of a dotted module name: that of
    its folder in the package's top folder (``ragspec.datastore.cli`` is on the floor of
    ``datastore``), or of itself for a module of the top folder; None when no floor names
    it."""
    inner = module[len(package) + 1 :] if module != package else ""
    first = inner.split(".")[0]
    for i, (_, names) in enumerate(floors):
        if first in names:
            return i
    return None


def unplaced_modules(graph: dict[str, list[Edge]], package: str, floors=FLOORS) -> list[str]:
    """Modules (and imported names that are no module) no floor holds."""
    names = set(graph) | {e.target for es in graph.values() for e in es}
    return sorted(m for m in names if floor_of(m, package, floors) is None)


def upward_imports(graph: dict[str, list[Edge]], package: str, floors=FLOORS) -> list[str]:
    """Imports of a module on a higher floor than the importer's, as ``"a (floor) ->
    b (floor) :line"``."""
    out = []
    for source, edges in sorted(graph.items()):
        low = floor_of(source, package, floors)
        for e in edges:
            high = floor_of(e.target, package, floors)
            if low is not None and high is not None and high > low:
                out.append(f"{source} ({floors[low][0]}) -> {e.target} ({floors[high][0]}) :{e.line}")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(graph: dict[str, list[Edge]], package: str) -> list[str]:
    """Imports of another module's private names (``from m import _x``) or of a private
    module (``m._x``) from outside the folder that holds them, as ``"a :line takes _x from
    m"``. Rule: a package folder's private names are the folder's own: its modules, and
    those of its sub-folders, may take each other's (``backend/hf.py`` takes
    ``backend/native.py``'s ``_linear_modules``); no module outside it may. The package's top folder
    holds every floor, so there each module's private names are its own (and its
    ``__init__``'s are private to it)."""
    out = []
    for source, edges in sorted(graph.items()):
        for e in edges:
            parent, _, last = e.target.rpartition(".")
            if _private(last):
                folder, taken = parent, [last]  # a private module: its folder's
            else:
                taken = [n for n in e.names if _private(n)]
                is_package = any(m.startswith(e.target + ".") for m in graph)
                folder = e.target if is_package else parent  # an __init__ owns its folder
            if not taken or (folder != package and (source == folder or source.startswith(folder + "."))):
                continue
            out.append(f"{source} :{e.line} takes {', '.join(taken)} from {e.target}")
    return out


def _package_graph() -> dict[str, list[Edge]]:
    return import_graph(PACKAGE.parent, PACKAGE.name)


def test_the_package_has_no_import_cycles():
    cycles = [" -> ".join(c) for c in import_cycles(_package_graph())]
    assert cycles == []


def test_every_module_is_on_a_floor():
    """A new module must be placed in :data:`FLOORS` (and so on the house's plan)."""
    assert unplaced_modules(_package_graph(), PACKAGE.name) == []


def test_imports_point_down_only():
    """core -> backend -> drafters -> loop -> front ends and bench: a module imports only
    its own floor or lower ones, inside functions too (``if TYPE_CHECKING:`` imports do
    not count: they run only under the type checker)."""
    assert upward_imports(_package_graph(), PACKAGE.name) == []


def test_no_module_takes_another_packages_private_names():
    assert private_imports(_package_graph(), PACKAGE.name) == []


def test_floors_are_folders():
    """Each floor names modules of the package's top folder and whole sub-folders, once
    each, every one of them there: nothing inside a sub-folder is placed by its own name."""
    names = [n for _, floor in FLOORS for n in floor]
    assert len(names) == len(set(names))
    assert [n for n in names if "." in n or "*" in n] == []
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(set(names) - {""} - top) == []  # no floor names what is not there
    assert sorted(top - set(names) - {"__init__"}) == []


def test_old_paths_of_moved_modules_hold_no_code():
    """A module that moved whole stays one release at its old path as a deprecated alias
    (:func:`ragspec.deprecation.moved_module`) importing nothing of the package but the
    deprecation helper: what it names is looked up on use, so an old path left in a lower
    folder (``ragspec/datastore/cli.py``) holds no import of a higher floor."""
    graph = _package_graph()
    aliases = {}
    for rel, tree in _modules():
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "moved_module"]
        if calls:
            aliases[rel] = tree
    assert "datastore/cli.py" in aliases and "eagle/train.py" in aliases
    for rel, tree in aliases.items():
        name = PACKAGE.name + "." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        assert {e.target for e in graph[name]} == {PACKAGE.name + ".deprecation"}, rel
        kinds = {type(statement).__name__ for statement in tree.body}
        assert kinds <= {"Expr", "ImportFrom", "AnnAssign", "Assign"}, (rel, kinds)  # no def, no class


def test_nothing_imports_the_old_path_of_a_moved_module():
    """Regression (code merged beside a move still imported ``ragspec.cli_common`` and
    ``ragspec.bench.data``, which warn): the package, its scripts and examples import a
    moved module at its new path only."""
    graph = _package_graph()
    aliases = set()
    for rel, tree in _modules():
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "moved_module" for n in ast.walk(tree)):
            aliases.add(PACKAGE.name + "." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    assert aliases
    inside = sorted((src, e.target) for src, edges in graph.items() for e in edges if e.target in aliases)
    assert inside == []
    root = PACKAGE.parent
    outside = []
    for path in sorted([*(root / "scripts").glob("*.py"), *(root / "examples").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            outside += [(path.name, n) for n in names if n in aliases]
    assert outside == []


def test_every_import_of_the_package_is_read_by_the_checker():
    """The graph reads ``import`` statements: the package reaches none of its own modules
    through ``importlib.import_module`` / ``__import__`` (which it could not see), except
    the deprecation helper's look-ups of moved names."""
    found = []
    for rel, tree in _modules():
        if rel == "deprecation.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")):
                first = node.args[0] if node.args else None
                if not (isinstance(first, ast.Constant) and not str(first.value).startswith((PACKAGE.name, "."))):
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert found == []


# --- the checker itself, on planted trees
PLANTED_FLOORS = (("low", ("core",)), ("high", ("", "app")))


def _fake_package(root: Path, extra: Optional[dict[str, str]] = None) -> dict[str, list[Edge]]:
    """The import graph of a small package ``fake`` written under ``root``: ``core`` (the
    low floor) and ``app`` (the high one), ``app`` importing ``core`` every way the checker
    must read; ``extra``: more files (path -> text), replacing those of the same path."""
    files = {
        "fake/__init__.py": "from .app import main\n",
        "fake/core/__init__.py": "from .types import Thing\n",
        "fake/core/types.py": "class Thing: ...\n",
        "fake/core/_util.py": "def helper(): ...\n",
        "fake/core/tree.py": "from . import _util\nfrom .types import Thing\n",
        "fake/app/__init__.py": "",
        "fake/app/main.py": (
            "from typing import TYPE_CHECKING\n"
            "\n"
            "import fake.core.types\n"
            "from ..core import tree, Thing\n"
            "\n"
            "if TYPE_CHECKING:\n"
            "    from fake import main  # the type checker's only: no edge\n"
            "\n"
            "def run():\n"
            "    from fake.core.types import Thing  # inside a function: an edge\n"
            "    return Thing()\n"
            "\n"
            "def _hidden(): ...\n"
        ),
    }
    files.update(extra or {})
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return import_graph(root, "fake")


def test_checker_reads_relative_nested_and_type_checking_imports(tmp_path):
    graph = _fake_package(tmp_path)
    main = sorted((e.target, e.line, e.names) for e in graph["fake.app.main"])
    # line 3 `import fake.core.types`; line 4 `from ..core import tree, Thing`: the module
    # fake.core.tree and the name Thing of fake.core; line 10 the import inside run(); the
    # TYPE_CHECKING import is no edge
    assert main == [
        ("fake.core", 4, ("Thing",)),
        ("fake.core.tree", 4, ()),
        ("fake.core.types", 3, ()),
        ("fake.core.types", 10, ("Thing",)),
    ]
    assert [e.target for e in graph["fake.core.tree"]] == ["fake.core._util", "fake.core.types"]
    assert [e.target for e in graph["fake"]] == ["fake.app.main"]
    assert import_cycles(graph) == []
    assert upward_imports(graph, "fake", PLANTED_FLOORS) == []
    assert unplaced_modules(graph, "fake", PLANTED_FLOORS) == []
    assert private_imports(graph, "fake") == []  # core/tree takes core/_util: its own folder


def test_checker_reports_a_planted_cycle(tmp_path):
    # types -> tree (a function's import) -> types: reported as a path
    graph = _fake_package(tmp_path, {"fake/core/types.py": "def f():\n    from .tree import Thing\n"})
    assert import_cycles(graph) == [["fake.core.tree", "fake.core.types", "fake.core.tree"]]


def test_checker_reports_a_planted_upward_import(tmp_path):
    graph = _fake_package(tmp_path, {"fake/core/_util.py": "def f():\n    from ..app import main\n"})
    assert upward_imports(graph, "fake", PLANTED_FLOORS) == ["fake.core._util (low) -> fake.app.main (high) :2"]
    # main -> tree -> _util -> main: a cycle as well
    assert import_cycles(graph) == [["fake.app.main", "fake.core.tree", "fake.core._util", "fake.app.main"]]


def test_checker_reports_an_unplaced_module_and_private_imports(tmp_path):
    graph = _fake_package(
        tmp_path,
        {
            "fake/extra.py": "from .app.main import _hidden\nfrom .core import _util\nimport fake.gone\n",
            "fake/app/other.py": "from .main import _hidden  # the same folder: allowed\n",
        },
    )
    assert unplaced_modules(graph, "fake", PLANTED_FLOORS) == ["fake.extra", "fake.gone"]
    assert private_imports(graph, "fake") == [
        "fake.extra :1 takes _hidden from fake.app.main",
        "fake.extra :2 takes _util from fake.core._util",
    ]


def test_checker_places_a_command_module_by_its_folder(tmp_path):
    # a command module inside the low folder importing the high one: the folder decides
    # its floor, whatever its name
    graph = _fake_package(tmp_path, {"fake/core/cli.py": "import argparse\n\nfrom ..app import main\n"})
    assert floor_of("fake.core.cli", "fake", PLANTED_FLOORS) == 0
    assert upward_imports(graph, "fake", PLANTED_FLOORS) == ["fake.core.cli (low) -> fake.app.main (high) :3"]


def _python_only(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or Path(folder, n).is_dir())]


def test_checker_reports_command_modules_planted_below_the_top_floor_in_a_copy_of_the_package(tmp_path):
    """The real floors: the datastore command written back into ``ragspec/datastore/``
    (where it lived, importing the engine builder) and the EAGLE trainer's data written back
    into ``ragspec/eagle/`` (borrowing the bench's category groups, as it did) are upward
    imports from the drafters' floor; the copy is otherwise clean."""
    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=_python_only)
    planted = tmp_path / PACKAGE.name
    (planted / "datastore" / "cli.py").write_text(
        "def cmd_build(args):\n    from ragspec.loading import load_engine\n", encoding="utf-8"
    )
    (planted / "eagle" / "train_data.py").write_text(
        "def _group(category):\n    from ..bench.data import category_group\n", encoding="utf-8"
    )
    graph = import_graph(tmp_path, PACKAGE.name)
    assert upward_imports(graph, PACKAGE.name) == [
        "ragspec.datastore.cli (drafters) -> ragspec.loading (loop) :2",
        "ragspec.eagle.train_data (drafters) -> ragspec.bench.data (top) :2",
    ]


def test_checker_reports_a_cycle_and_an_upward_import_planted_in_a_copy_of_the_package(tmp_path):
    """The real floors: ``ragspec.errors`` (core) made to import the engine (loop), which
    imports ``errors``."""

    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=_python_only)
    errors = tmp_path / PACKAGE.name / "errors.py"
    text = errors.read_text(encoding="utf-8") + "\n\ndef _planted():\n    from .engine import Engine\n"
    errors.write_text(text, encoding="utf-8")
    line = text.count("\n")
    graph = import_graph(tmp_path, PACKAGE.name)
    assert any("ragspec.errors" in c and "ragspec.engine" in c for c in import_cycles(graph))
    assert f"ragspec.errors (core) -> ragspec.engine (loop) :{line}" in upward_imports(graph, PACKAGE.name)


# ---------------------------------------------------------------------------- declared, not probed
# What a target is and computes with is declared (the Target protocol's attributes, its
# capabilities); an engine's members are typed. Outside the backend nothing finds them out
# with getattr/hasattr: a probe hides a missing declaration behind a default.
PROBED_NAMES = ("target", "engine", "eng")


def _probed(node: ast.expr) -> Optional[str]:
    """The name a ``getattr``/``hasattr`` first argument ends in (``engine.target`` ->
    ``target``, ``self._engine`` -> ``_engine``), or None for another expression."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _names_a_target_or_engine(name: str) -> bool:
    bare = name.lstrip("_")
    return bare in PROBED_NAMES or bare.endswith(tuple(f"_{n}" for n in PROBED_NAMES))


def target_probes(root: Path, package: str, exempt: tuple[str, ...] = ("backend",)) -> list[str]:
    """Every ``getattr(x, ...)`` / ``hasattr(x, ...)`` of the package folder ``root /
    package`` whose ``x`` names a target or an engine (:data:`PROBED_NAMES`, with leading
    underscores or as a suffix: ``engine.target``, ``self._engine``, ``cpu_target``),
    outside the sub-folders ``exempt`` (the backend itself), as ``"module.py:line
    getattr(x, 'name')"``."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root / package).as_posix()
        if rel.split("/")[0] in exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr"):
                continue
            if not node.args or not _names_a_target_or_engine(_probed(node.args[0]) or ""):
                continue
            attr = node.args[1] if len(node.args) > 1 else None
            what = repr(attr.value) if isinstance(attr, ast.Constant) else "..."
            out.append(f"{rel}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, {what})")
    return out


def test_nothing_outside_the_backend_probes_a_target_or_an_engine():
    """Outside ``backend/``, a target's members (``numerics``, ``max_length``, ...) and its
    optional capabilities are read as declared (``target.numerics``,
    ``target.capability(Capability.SPEED_UPS)``), an engine's as typed, never found with
    ``getattr``/``hasattr``."""
    assert target_probes(PACKAGE.parent, PACKAGE.name) == []


def test_checker_reports_planted_target_and_engine_probes(tmp_path):
    files = {
        "fake/__init__.py": "",
        "fake/app.py": (
            "def report(engine, tokenizer):\n"
            "    fast = getattr(engine.target, 'numerics', 'exact')\n"
            "    name = getattr(engine, 'model_name', None)\n"
            "    if hasattr(tokenizer, 'chat_template'):  # not a target: fine\n"
            "        pass\n"
            "    return fast, name\n"
            "\n"
            "class Front:\n"
            "    def label(self):\n"
            "        return getattr(self._engine, 'model_name', '') or hasattr(self.cpu_target, 'skinny')\n"
        ),
        "fake/backend/__init__.py": "",
        "fake/backend/hf.py": "def native(target):\n    return getattr(target, 'native', None)  # its own floor\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert target_probes(tmp_path, "fake") == [
        "app.py:2 getattr(engine.target, 'numerics')",
        "app.py:3 getattr(engine, 'model_name')",
        "app.py:10 getattr(self._engine, 'model_name')",
        "app.py:10 hasattr(self.cpu_target, 'skinny')",
    ]


def test_checker_reports_a_target_probe_planted_in_a_copy_of_the_package(tmp_path):
    """The real package: a ``getattr(engine.target, ...)`` planted in the CLI is reported;
    the same probe inside ``backend/`` is not."""

    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=_python_only)
    probe = "\n\ndef _planted(engine):\n    return getattr(engine.target, 'numerics', 'exact')\n"
    cli = tmp_path / PACKAGE.name / "cli" / "commands.py"
    text = cli.read_text(encoding="utf-8") + probe
    cli.write_text(text, encoding="utf-8")
    hf = tmp_path / PACKAGE.name / "backend" / "hf.py"
    hf.write_text(hf.read_text(encoding="utf-8") + probe, encoding="utf-8")
    assert target_probes(tmp_path, PACKAGE.name) == [
        f"cli/commands.py:{text.count(chr(10))} getattr(engine.target, 'numerics')"
    ]


def test_no_backend_switches_on_its_states_type():
    """Backends are siblings: the native step's state is its own target's
    (``backend/cpu/native_target.py``, which refuses any other), never a case another target
    tests for."""
    from ragspec.backend.cpu.native_target import NativeTarget
    from ragspec.backend.hf import HFTarget

    assert not issubclass(NativeTarget, HFTarget)
    offenders = []
    for rel, tree in _modules():
        if rel == "backend/cpu/native_target.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                if "NativeKVState" in ast.unparse(node.args[1]):
                    offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []
