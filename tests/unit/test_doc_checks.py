"""``scripts/check_doc_links.py``: broken relative links and citations of this project's
tracker in README.md and docs/ fail; and the help texts a new user reads."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_doc_links", ROOT / "scripts" / "check_doc_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def site(tmp_path):
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "ceiling-run1.json").write_text("{}")
    (tmp_path / "README.md").write_text("# ragspec\n\nSee [usage](docs/usage.md#options).\n")
    return tmp_path


@pytest.mark.parametrize(
    "line",
    [
        "The queue (issue 42: 40 sockets held every place).",
        "Fixed in Issue #42.",
        "See issues 41 and 42.",
        "Measured ([record](bench/issue22-ceiling-run1.json)).",
        "A regression (#42) is gone.",
        "```bash\nragspec bench --replay docs/bench/issue22-replay.jsonl\n```",
    ],
)
def test_a_tracker_number_in_the_docs_fails(site, line):
    """Regression: docs/server.md cited "issue 42" and usage.md and caches.md linked
    records named after issues."""
    checker = _checker()
    (site / "docs" / "usage.md").write_text(f"# Usage\n\n## Options\n\n{line}\n")
    found = checker.tracker_numbers(site)
    assert len(found) == 1 and found[0].startswith("docs/usage.md:"), found


@pytest.mark.parametrize(
    "line",
    [
        "Measured ([record](bench/ceiling-run1.json)), 42 issues of throughput aside.",
        "llama.cpp's own bug ([upstream](https://github.com/ggml-org/llama.cpp/issues/4242#issuecomment-1)).",
        "Prompts 1-8; the `Document 1:` layout; a heading [link](#options).",
    ],
)
def test_text_without_tracker_numbers_passes(site, line):
    checker = _checker()
    (site / "docs" / "usage.md").write_text(f"# Usage\n\n## Options\n\n{line}\n")
    assert checker.tracker_numbers(site) == []
    assert checker.broken_links(site)[0] == []


def test_the_docs_cite_no_tracker_number_and_no_broken_link():
    checker = _checker()
    assert checker.tracker_numbers() == []
    assert checker.broken_links()[0] == []


def _options(parser: argparse.ArgumentParser, path: str = "ragspec"):
    """(command path, action) of every option of ``parser`` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings:
            yield path, action


def test_max_draft_tokens_shows_its_default_in_every_help():
    """Regression: ``--max-draft-tokens`` showed no default in any help."""
    from ragspec.cli import build_parser

    found = [(path, a.help) for path, a in _options(build_parser()) if "--max-draft-tokens" in a.option_strings]
    assert len(found) >= 5, found  # generate, summarize, bench, serve, eagle bench
    assert all("default 8" in (text or "") for _, text in found), found


def test_serve_help_points_to_the_ray_page():
    """Regression: ``serve --help`` pointed to a README section "Ray Serve" that does not
    exist (the page is docs/ray.md)."""
    from ragspec.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    assert "docs/ray.md" in text and "see README" not in text
    assert (ROOT / "docs" / "ray.md").is_file()
