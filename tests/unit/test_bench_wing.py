"""The measuring wing's place in the house, read from the AST (imports inside functions
count, ``TYPE_CHECKING`` ones do not): the bench <-> compare and cli <-> bench_concurrency
cycles stay gone, the core's policy imports nothing from the backend, nothing below the
front ends imports the bench, and no module takes another package's private names."""

import ast
from pathlib import Path

import ragspec

PACKAGE = Path(ragspec.__file__).parent
FRONT_ENDS = ("ragspec.cli", "ragspec.cli_common", "ragspec.bench", "ragspec.integrations", "ragspec.eagle.cli")


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imports() -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or "")}, ragspec's only."""
    modules = {_module_name(p)[0] for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[tuple[str, str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        name, is_pkg = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        out = graph.setdefault(name, set())
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                out |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "ragspec"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                if base.split(".")[0] != "ragspec":
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add((sub, "") if sub in modules else (base, a.name))
    return graph


def _cycles(graph: dict[str, set[tuple[str, str]]]) -> list[list[str]]:
    edges = {m: {t for t, _ in ts if t in graph and t != m} for m, ts in graph.items()}
    cycles, done = [], set()

    def visit(m, path):
        if m in path:
            cycles.append(path[path.index(m) :] + [m])
            return
        if m in done:
            return
        for t in sorted(edges[m]):
            visit(t, path + [m])
        done.add(m)

    for m in sorted(edges):
        visit(m, [])
    return cycles


def test_the_bench_and_the_cli_are_in_no_import_cycle():
    cycles = _cycles(_imports())
    wing = [c for c in cycles if any(m.startswith(FRONT_ENDS) or m == "ragspec.calibrate" for m in c)]
    assert wing == []


def test_policy_imports_nothing_from_the_backend_and_only_front_ends_import_the_bench():
    graph = _imports()
    assert not any(t.startswith("ragspec.backend") for t, _ in graph["ragspec.policy"])
    importers = sorted(m for m, ts in graph.items() for t, _ in ts if t.startswith("ragspec.bench"))
    training = ("ragspec.eagle.train", "ragspec.eagle.train_data", "ragspec.eagle.train_loop")
    assert all(m.startswith(FRONT_ENDS) or m in training for m in importers), importers


def test_no_module_imports_another_packages_private_names():
    offenders = []
    for m, ts in _imports().items():
        own = m if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file() else m.rpartition(".")[0]
        for t, name in ts:
            theirs = t if (PACKAGE.parent / t.replace(".", "/") / "__init__.py").is_file() else t.rpartition(".")[0]
            if name.startswith("_") and not name.startswith("__") and theirs != own:
                offenders.append(f"{m}: {t}.{name}")
    assert offenders == []
