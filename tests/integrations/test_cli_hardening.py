"""The CLI's one-line-error promise under the cases of issue 17: a damaged datastore no
longer breaks ``ragspec generate --datastore`` (its bad drafts are dropped: the output is
the one without it), and no failure prints a traceback."""

from __future__ import annotations

import json
import logging

import numpy as np
from _integ_helpers import make_char_tokenizer


def _generate(capsys, *args) -> tuple[int, str, str]:
    from ragspec.cli import main

    capsys.readouterr()
    rc = main(["generate", "the cat sat on the mat", "--max-new-tokens", "24", "--json", "--eagle", "none", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_generate_with_a_damaged_datastore_prints_no_traceback(tmp_path, tiny_folder, capsys, monkeypatch):
    """Regression (issue 17 case 2): ``ragspec generate --datastore`` over a datastore whose
    tokens.bin held ids outside the vocabulary printed a 55-line traceback (IndexError in
    embed_tokens). Now it generates, token-identical to the run without the datastore."""
    from ragspec.datastore import build_datastore

    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    rc, out, err = _generate(capsys, "--model", str(tiny_folder))
    assert rc == 0, err
    want = json.loads(out)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # the chat-templated prompt, then the answer: the datastore drafts the answer at every step
    (corpus / "a.txt").write_text(("user: the cat sat on the mat\nassistant:" + want["text"] + "\n") * 4)
    tok = make_char_tokenizer()
    build_datastore([corpus], tmp_path / "ds", tok, progress=False)
    path = tmp_path / "ds" / "shard-00000" / "tokens.bin"
    ids = np.fromfile(path, dtype="<i4")
    ids[(ids >= 0) & (np.arange(len(ids)) % 8 == 7)] = 10_000  # far outside the vocabulary
    ids.tofile(path)
    rc, out, err = _generate(capsys, "--model", str(tiny_folder), "--datastore", str(tmp_path / "ds"))
    assert rc == 0 and "Traceback" not in err, err
    got = json.loads(out)
    assert got["token_ids"] == want["token_ids"]
    assert got["stats"]["num_invalid_draft_tokens"] > 0


def test_cli_unexpected_failure_is_one_line(monkeypatch, capsys):
    """Any failure that is not a typed error is one line too (the traceback only with -v)."""
    from ragspec.cli import commands

    def boom(args):
        raise IndexError("index out of range in self\nand a second line")

    monkeypatch.setattr(commands, "cmd_generate", boom)
    capsys.readouterr()
    assert commands.main(["generate", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("ragspec: internal error: IndexError: index out of range in self and a second line")


def test_cli_binary_empty_or_directory_inputs_are_typed_errors_regression(tmp_path, tiny_folder, capsys):
    """Regression (fresh-user trial): a binary ``--data`` file ended in ``internal error:
    UnicodeDecodeError``; a binary ``--prompt-file`` or ``--docs`` was decoded with
    replacement characters and prefilled (3,873 tokens of garbage), an empty one accepted
    silently; a directory was "file not found"; ``no prompts selected`` named neither the
    file nor its categories. Each is now a one-line typed error (rc 2) before any model loads."""
    from ragspec.cli import main

    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(256)) * 16)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    nul = tmp_path / "nul.txt"
    nul.write_text("abc\x00def")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["q"]}) + "\n")
    cases = [
        (["generate", "--prompt-file", str(binary)], "is not UTF-8 text"),
        (["generate", "--prompt-file", str(empty)], "is empty"),
        (["generate", "--prompt-file", str(tmp_path)], "is a directory"),
        (["generate", "x", "--docs", str(nul)], "NUL bytes"),
        (["generate", "x", "--docs", str(empty)], "is empty"),
        (["summarize", str(binary)], "is not UTF-8 text"),
        (["bench", "--data", str(binary), "--limit", "1"], "not UTF-8"),
        (["bench", "--data", str(data), "--categories", "nope", "--limit", "1"], "its categories: rag"),
        (["bench", "--data", str(empty), "--limit", "1"], "has no rows"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        rc = main([*argv, "--model", str(tiny_folder)])
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert message in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)


def test_generate_json_reports_the_drafting_in_effect(tiny_folder, capsys, monkeypatch, caplog):
    """``generate --json`` names the drafting that ran: retrieval alone without a head (the
    CPU's default, and what ``--drafting merged --eagle none`` falls back to, with a
    warning), ``off`` with ``--no-speculation``; the output is the same in each."""
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    runs = {}
    for name, extra in {
        "default": (),
        "plain": ("--no-speculation",),
        "merged": ("--drafting", "merged"),
    }.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ragspec.loading"):
            rc, out, err = _generate(capsys, "--model", str(tiny_folder), *extra)
        assert rc == 0, err
        runs[name] = (json.loads(out), [r.getMessage() for r in caplog.records])
    assert runs["default"][0]["drafting"] == "retrieval" and runs["default"][0]["numerics"] == "exact"
    assert runs["plain"][0]["drafting"] == "off"
    assert runs["merged"][0]["drafting"] == "retrieval"
    assert any("--drafting merged needs an EAGLE head" in m for m in runs["merged"][1]), runs["merged"][1]
    assert not any("needs an EAGLE head" in m for m in runs["default"][1])
    assert runs["default"][0]["token_ids"] == runs["plain"][0]["token_ids"] == runs["merged"][0]["token_ids"]
