"""What a user meets first (issue 40, item 4), run through ``ragspec.cli.main`` on a tiny
random model: progress lines on stderr while the model loads and the latency model is
calibrated (none with ``-q``, none for a library caller), and the global options after
the command."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ragspec.progress import PROGRESS_LOGGER


@pytest.fixture(autouse=True)
def _pristine_progress_logger(monkeypatch, tmp_path):
    """Each test starts, and leaves, the progress logger as a library user has it, and the
    torch thread count as it was (the CLI sets both); its own ragspec cache (the latency
    calibration is cached there)."""

    def reset() -> None:
        log = logging.getLogger(PROGRESS_LOGGER)
        for h in list(log.handlers):
            log.removeHandler(h)
        log.setLevel(logging.NOTSET)
        log.propagate = True

    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAGSPEC_RECALIBRATE", raising=False)
    threads = torch.get_num_threads()
    reset()
    yield
    reset()
    torch.set_num_threads(threads)


def _run(capsys, *argv) -> tuple[int, str, str]:
    from ragspec.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_progress_lines_on_stderr_while_loading_and_calibrating(tiny_folder, capsys):
    """Regression (issue 40): nothing was printed while the model loaded and the latency
    model was calibrated (``make run`` silent ~4 minutes, ``ragspec serve`` ~6)."""
    rc, out, err = _run(capsys, "generate", "the cat", "--model", str(tiny_folder), "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    json.loads(out)  # stdout is the answer alone
    lines = [line for line in err.splitlines() if line.startswith("ragspec: ")]
    name = tiny_folder.name
    assert lines[0] == f"ragspec: loading {name} (transformers folder)...", err
    assert lines[1].startswith(f"ragspec: loading {name}: done in ") and lines[1].endswith(" s"), err
    assert lines[2].startswith("ragspec: calibrating the latency model (~10 s"), err
    assert lines[3].startswith("ragspec: calibrating the latency model: done in "), err
    # the second start finds the calibration in the cache: no calibration line
    rc, out, err = _run(capsys, "generate", "the cat", "--model", str(tiny_folder), "--max-new-tokens", "4", "--json")
    assert rc == 0 and "ragspec: loading" in err and "calibrating" not in err, err


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_silences_the_progress_lines(tiny_folder, capsys, where):
    argv = ["generate", "the cat", "--model", str(tiny_folder), "--max-new-tokens", "4", "--json"]
    argv = ["-q", *argv] if where == "before" else [*argv, "-q"]
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    assert "ragspec: " not in err and json.loads(out)["text"]


def test_a_library_caller_gets_no_progress_lines(tiny_folder, capsys):
    from ragspec.loading import load_engine

    capsys.readouterr()
    load_engine(str(tiny_folder), eagle="none")
    assert "ragspec: " not in capsys.readouterr().err


def test_threads_after_the_subcommand_is_accepted_end_to_end(tiny_folder, capsys):
    """Regression (issue 40): ``ragspec generate --threads 2 --max-new-tokens 1 hi`` took
    "2" as the prompt and failed on "hi"."""
    rc, out, err = _run(
        capsys, "generate", "--threads", "1", "--max-new-tokens", "1", "hi", "--model", str(tiny_folder), "--json"
    )
    assert rc == 0, err
    assert torch.get_num_threads() == 1
    assert len(json.loads(out)["token_ids"]) == 1
    rc, _, err = _run(capsys, "generate", "hi", "--threads", "0", "--model", str(tiny_folder))
    assert rc == 2 and err == "ragspec: error: --threads must be >= 1\n"


def test_verbose_after_the_subcommand_logs_info(tiny_folder, capsys, monkeypatch):
    levels = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    for flag in ("-v", "--verbose"):
        rc, _, err = _run(capsys, "generate", "hi", "--max-new-tokens", "1", "--model", str(tiny_folder), flag)
        assert rc == 0, err
    rc, _, err = _run(capsys, "generate", "hi", "--max-new-tokens", "1", "--model", str(tiny_folder))
    assert levels == [logging.INFO, logging.INFO, logging.WARNING]


def test_generate_docs_reach_the_models_prompt_and_draft_docs_the_drafter_only(tiny_folder, tmp_path, capsys):
    """``--docs`` are grounding the model reads (the prompt grows by them, the answer is the
    grounded prompt's); ``--draft-docs`` only the drafter reads (the same prompt and answer
    as without)."""
    from ragspec.prompts import grounded_text

    doc = tmp_path / "pump.txt"
    doc.write_text("the pump is serviced every week.")
    common = ["--model", str(tiny_folder), "--max-new-tokens", "8", "--json", "-q"]

    def run(*extra):
        rc, out, err = _run(capsys, "generate", *extra, *common)
        assert rc == 0, err
        return json.loads(out)

    plain = run("what is it")
    grounded = run("what is it", "--docs", str(doc))
    drafted = run("what is it", "--draft-docs", str(doc))
    laid_in = run(grounded_text([doc.read_text()], "what is it"))
    assert grounded["stats"]["num_prompt_tokens"] > plain["stats"]["num_prompt_tokens"]
    assert grounded["token_ids"] == laid_in["token_ids"]
    assert drafted["stats"]["num_prompt_tokens"] == plain["stats"]["num_prompt_tokens"]
    assert drafted["token_ids"] == plain["token_ids"]
