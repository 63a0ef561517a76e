"""The command line as a new user meets it: the global options (-v, -q, --threads) before or
after the command, and a help text on every option of every command (issue 40, item 4)."""

from __future__ import annotations

import argparse

import pytest

from ragspec.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("ragspec",)):
    """(command path, parser) of ``parser`` and every subcommand under it, at every depth."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_of_every_command_has_a_help_without_tracker_numbers():
    missing, tracker = [], []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            where = f"{' '.join(path)} {name}"
            if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
                missing.append(where)
            elif "issue " in action.help.lower():
                tracker.append(f"{where}: {action.help}")
    assert not missing, "options without a help text:\n" + "\n".join(missing)
    assert not tracker, "help texts naming tracker issues:\n" + "\n".join(tracker)


def test_every_command_takes_the_global_options():
    for path, parser in _parsers(build_parser()):
        flags = {s for a in parser._actions for s in a.option_strings}
        assert {"-v", "--verbose", "-q", "--quiet", "--threads"} <= flags, " ".join(path)


def test_threads_after_the_subcommand_is_accepted():
    """Regression (issue 40): ``ragspec generate --threads 2 --max-new-tokens 1 hi`` took "2"
    as the prompt and failed on "hi"; ``--threads`` was a main-parser option only."""
    args = build_parser().parse_args(["generate", "--threads", "2", "--max-new-tokens", "1", "hi"])
    assert args.threads == 2 and args.prompt == "hi" and args.max_new_tokens == 1
    # before the command, as before; and the subcommand does not reset it to its default
    args = build_parser().parse_args(["--threads", "3", "generate", "hi"])
    assert args.threads == 3 and args.prompt == "hi"
    # nested commands and serve too
    assert build_parser().parse_args(["datastore", "info", "d", "--threads", "1"]).threads == 1
    assert build_parser().parse_args(["serve", "--threads", "2"]).threads == 2
    assert build_parser().parse_args(["generate", "hi"]).threads is None


@pytest.mark.parametrize(
    "argv, verbose, quiet",
    [
        (["generate", "hi"], False, False),
        (["-v", "generate", "hi"], True, False),
        (["generate", "-v", "hi"], True, False),
        (["generate", "hi", "--verbose"], True, False),
        (["-q", "generate", "hi"], False, True),
        (["generate", "hi", "-q"], False, True),
        (["serve", "--quiet", "-v"], True, True),
        (["model", "info", "-q"], False, True),
        (["-v", "eagle", "train", "-o", "out", "-q"], True, True),
    ],
)
def test_verbose_and_quiet_after_the_subcommand_are_accepted(argv, verbose, quiet):
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_drafting_help_speaks_the_users_words():
    """Regression (issue 40): ``--drafting``'s help said "the behaviour before issue 22"."""
    parser = build_parser()
    gen = next(sub for path, sub in _parsers(parser) if path == ("ragspec", "generate"))
    (drafting,) = [a for a in gen._actions if "--drafting" in a.option_strings]
    assert "issue" not in drafting.help and "select" in drafting.help


def test_every_commands_help_renders():
    # a stray '%' in a help text breaks argparse's formatting only when --help is asked for
    for path, parser in _parsers(build_parser()):
        assert "global options" in parser.format_help() or path == ("ragspec",), " ".join(path)


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"], ["serve"]])
def test_recalibrate_is_accepted_by_every_command_that_calibrates(command):
    # --recalibrate was a serve option only: generate and bench reused a cached table with no way
    # to force a new measurement but RAGSPEC_RECALIBRATE
    from ragspec.cli import build_parser

    args = build_parser().parse_args([*command, "--recalibrate"])
    assert args.recalibrate is True
    assert build_parser().parse_args(command).recalibrate is False


def test_sampling_penalties_reach_the_request():
    from ragspec.cli import request_params_from_args

    for command in ("generate", "summarize"):
        argv = [command, "--frequency-penalty", "0.5", "--presence-penalty", "-0.3", "--repetition-penalty", "1.2"]
        argv += ["--min-p", "0.1", "--min-tokens", "3", "--temperature", "0.7"]
        args = build_parser().parse_args(argv + (["hello"] if command == "generate" else ["doc.txt"]))
        p = request_params_from_args(args)
        assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.3, 1.2)
        assert (p.min_p, p.min_tokens, p.sampling.min_p) == (0.1, 3, 0.1)


def test_ragspec_version_prints_the_version(capsys):
    """Regression: there was no ``ragspec --version``."""
    from ragspec import __version__
    from ragspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"ragspec {__version__}\n"


def test_a_cli_error_names_the_flag_not_the_python_argument(tmp_path, capsys):
    """Regression: ``ragspec datastore build`` into a folder in the way said "--overwrite
    (overwrite=True)"; the CLI names the flag only (and says so before loading a model)."""
    from ragspec.cli import main

    (tmp_path / "in.txt").write_text("a document")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("someone's file")
    code = main(["datastore", "build", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out"), "--model", "nowhere"])
    err = capsys.readouterr().err
    assert code == 2 and "--overwrite to replace the folder" in err and "overwrite=True" not in err
