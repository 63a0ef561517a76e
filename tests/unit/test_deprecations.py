"""Removed public names come back for one release as deprecated aliases that warn and name
what replaces them (no AttributeError or ImportError for a script written against 0.1.0)."""

from __future__ import annotations

import importlib

import pytest


def test_engine_from_pretrained_is_a_deprecated_alias_of_load_engine(monkeypatch):
    """Regression: ``Engine.from_pretrained`` was removed without a deprecation period;
    scripts written against it failed with an ``AttributeError``."""
    import ragspec.loading
    from ragspec import Engine

    calls = []

    def fake_load_engine(*args, **kwargs):
        calls.append((args, kwargs))
        return "engine"

    monkeypatch.setattr(ragspec.loading, "load_engine", fake_load_engine)
    with pytest.warns(DeprecationWarning, match=r"Engine\.from_pretrained is deprecated.*ragspec\.load_engine") as w:
        assert Engine.from_pretrained("m", "cpu", eagle="none", calibrate=False) == "engine"
    assert calls == [(("m", "cpu", None), {"eagle": "none", "calibrate": False})]
    assert w[0].filename == __file__  # the warning points at the caller's line


@pytest.mark.parametrize(
    "old_module, name, new_module",
    [
        ("ragspec.drafting", "PromptLookupDrafter", "ragspec.drafters"),
        ("ragspec.drafting", "DraftSession", "ragspec.drafters"),
        ("ragspec.drafting", "ngram_match", "ragspec.drafters"),
        ("ragspec.eagle", "SelectingDrafter", "ragspec.drafters"),
        ("ragspec.eagle", "WEIGHTS_FILE", "ragspec.eagle.head"),
        # modules that moved whole: the command line into ragspec.cli, training into
        # ragspec.training, the Spec-Bench reader down to ragspec.specbench
        ("ragspec.cli_common", "add_model_args", "ragspec.cli.common"),
        ("ragspec.doctor", "kernel_report", "ragspec.cli.doctor"),
        ("ragspec.datastore.cli", "add_datastore_commands", "ragspec.cli.datastore"),
        ("ragspec.eagle.cli", "add_eagle_commands", "ragspec.cli.eagle"),
        ("ragspec.eagle.train", "run_training", "ragspec.training"),
        ("ragspec.eagle.train", "TrainConfig", "ragspec.training"),
        ("ragspec.eagle.train_data", "DataConfig", "ragspec.training.data"),
        ("ragspec.eagle.train_loop", "ttt_mask", "ragspec.training.loop"),
        ("ragspec.bench.data", "category_group", "ragspec.specbench"),
        ("ragspec.bench.data", "DEFAULT_DATA", "ragspec.specbench"),
    ],
)
def test_moved_names_are_found_at_their_old_place_with_a_warning(old_module, name, new_module):
    old = importlib.import_module(old_module)
    with pytest.warns(DeprecationWarning, match=rf"{old_module}\.{name} is deprecated.*{new_module}\.{name}"):
        found = getattr(old, name)
    assert found is getattr(importlib.import_module(new_module), name)


def test_a_name_that_never_existed_is_still_an_attribute_error():
    import ragspec.drafting
    import ragspec.eagle

    with pytest.raises(AttributeError, match="no_such_name"):
        ragspec.drafting.no_such_name  # noqa: B018
    with pytest.raises(AttributeError):
        ragspec.eagle.no_such_name  # noqa: B018
    from ragspec.eagle import cli  # a submodule is still imported, not refused

    assert cli.__name__ == "ragspec.eagle.cli"


def test_a_moved_module_warns_where_it_is_used_and_knows_no_other_names():
    """``from ragspec.eagle.train import run_training`` (the old path of a moved module)
    warns at the importing line; a name the new module lacks is an AttributeError."""
    with pytest.warns(DeprecationWarning, match=r"ragspec\.eagle\.train\.run_training .*ragspec\.training") as w:
        from ragspec.eagle.train import run_training
    assert w[0].filename == __file__
    from ragspec.training import run_training as moved

    assert run_training is moved
    import ragspec.datastore.cli

    with pytest.raises(AttributeError, match="no_such_name"):
        ragspec.datastore.cli.no_such_name  # noqa: B018


def test_the_console_script_and_python_m_run_the_moved_command_line(capsys):
    """``ragspec = "ragspec.cli:main"`` (pyproject.toml) and ``python -m ragspec`` reach the
    command line in its package, every command group registered."""
    import re
    from pathlib import Path

    import ragspec.__main__
    import ragspec.cli.__main__

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    scripts = pyproject.split("[project.scripts]", 1)[1]
    module, _, attr = re.search(r'^ragspec = "([^"]+)"', scripts, re.M).group(1).partition(":")
    main = getattr(importlib.import_module(module), attr)
    assert main is ragspec.__main__.main is ragspec.cli.__main__.main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("model", "generate", "summarize", "bench", "doctor", "datastore", "serve", "eagle"):
        assert command in out


def test_python_m_old_datastore_cli_path_runs_the_group_not_nothing(monkeypatch, capsys):
    """Regression: ``python -m ragspec.datastore.cli datastore ...`` (the group's documented
    way to run alone before it moved) did nothing and exited 0; it warns and runs the
    group at its new place."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["ragspec.datastore.cli", "datastore", "--help"])
    monkeypatch.delitem(sys.modules, "ragspec.datastore.cli", raising=False)
    with pytest.warns(
        DeprecationWarning, match=r"python -m ragspec\.datastore\.cli .*python -m ragspec\.cli\.datastore"
    ):
        with pytest.raises(SystemExit) as done:
            runpy.run_module("ragspec.datastore.cli", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "build" in out and "info" in out
