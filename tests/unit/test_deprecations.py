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
