"""The house rules of the package, read from its source: only the backend and models.py
touch transformers beyond tokenizer/config types; nothing outside the drafters and the
engine builder inspects drafter classes; the folders are the import paths."""

import ast
from pathlib import Path

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
        if rel.startswith("backend/") or rel == "models.py":
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


def test_engine_is_built_only_by_the_loader():
    """Front ends build engines through ragspec.loading (Engine.from_pretrained delegates
    to it): no module outside it calls ``Engine(`` or sets an engine attribute after
    construction."""
    offenders = []
    for rel, tree in _modules():
        if rel in ("loading.py", "engine.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Engine" and rel != "bench/eagle.py":
                offenders.append(f"{rel}:{node.lineno} Engine(...)")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in ("engine", "variant")
                    ):
                        offenders.append(f"{rel}:{node.lineno} {t.value.id}.{t.attr} = ...")
    assert offenders == []
